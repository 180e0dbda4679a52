"""A dataclass of 5 or more fields is keyword-only (STYLE.md: positional seams): built as
``Progress(step=..., tokens_seen=...)``, never by position, so a field added, removed or moved
fails where it is built instead of shifting every value after it.

In ``model/``, ``pipeline/``, ``workflows/`` and ``benchmarks/``: every class decorated with
``@dataclass``/``@dataclasses.dataclass`` that declares 5 or more fields of its own (annotated
class attributes, ``ClassVar`` excluded) says ``kw_only=True``.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
ROOTS = ("model", "pipeline", "workflows", "benchmarks")
MAX_POSITIONAL_FIELDS = 4


def positional_dataclasses(source: str, path: str) -> list[str]:
    """``path::Class (n fields)`` of each dataclass in ``source`` with more than
    MAX_POSITIONAL_FIELDS fields of its own and no ``kw_only=True``."""
    out = []
    for node in ast.walk(ast.parse(source, filename=path)):
        if not isinstance(node, ast.ClassDef):
            continue
        decorators = [d for d in node.decorator_list
                      if (d.func if isinstance(d, ast.Call) else d).__class__ in (ast.Name, ast.Attribute)
                      and ast.unparse(d.func if isinstance(d, ast.Call) else d) in ("dataclass", "dataclasses.dataclass")]
        if not decorators:
            continue
        kw_only = any(isinstance(d, ast.Call) and any(k.arg == "kw_only" and isinstance(k.value, ast.Constant)
                                                      and k.value.value is True for k in d.keywords)
                      for d in decorators)
        fields = [s for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
                  and "ClassVar" not in ast.unparse(s.annotation)]
        if len(fields) > MAX_POSITIONAL_FIELDS and not kw_only:
            out.append(f"{path}::{node.name} ({len(fields)} fields)")
    return out


def test_dataclasses_of_five_fields_or_more_are_keyword_only():
    found = [name for root in ROOTS for file in sorted((REPO / root).rglob("*.py"))
             for name in positional_dataclasses(file.read_text(encoding="utf-8"), file.relative_to(REPO).as_posix())]
    assert not found, "add kw_only=True (and build them by keyword):\n  " + "\n  ".join(found)


def test_the_checker_counts_own_fields_and_reads_the_decorator():
    source = '''
import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar

@dataclass
class Four:
    a: int
    b: int
    c: int
    d: int = 0
    K: ClassVar[int] = 1

@dataclass(frozen=True)
class Five:
    a: int
    b: int
    c: int
    d: int
    e: list = field(default_factory=list)

@dataclasses.dataclass(frozen=True, kw_only=True)
class FiveByKeyword:
    a: int
    b: int
    c: int
    d: int
    e: int

@dataclasses.dataclass(kw_only=False)
class FiveSaidNot:
    a: int
    b: int
    c: int
    d: int
    e: int

class NotADataclass:
    a: int
    b: int
    c: int
    d: int
    e: int
'''
    assert positional_dataclasses(source, "m.py") == ["m.py::Five (5 fields)", "m.py::FiveSaidNot (5 fields)"]
