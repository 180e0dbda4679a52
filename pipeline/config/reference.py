"""The config's key reference, generated from the schema: every section and key with its type,
default and meaning, as ``--help`` text (`help_text`) and as docs/configuration.md's key tables
(`markdown`); and a resolved config as TOML (`to_toml`, ``--print-config``).

A key's meaning is the comment the schema writes for its field: the comment lines directly above
the field and the comment after it on its line (`pipeline/config/schema.py`, `operations.py`, and
`model/config.py`'s `ModelSizes` for ``[model]``), read from the source with `ast` and `tokenize`.
So the schema stays a commented recipe, and that commentary is the one text both `--help` and the
docs show. A section's description is its class docstring.

    python -m pipeline.config.reference            # print the key tables (Markdown)
    python -m pipeline.config.reference --write    # regenerate them in docs/configuration.md

Part of the pipeline core: standard library and the schema only.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import io
import math
import re
import sys
import textwrap
import tokenize
import types
import typing
from pathlib import Path
from typing import Any, NamedTuple

from .schema import Config

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
BEGIN = "<!-- generated: python -m pipeline.config.reference --write -->"
END = "<!-- end generated -->"
# The "in the cache key" column, from a field's metadata (`op`, `keyed_if_set`; schema.py's docstring)
CACHE_CELL = {True: "yes", False: "no", "if_set": "when set"}


class Key(NamedTuple):
    section: str
    key: str
    type: str  # as `spell_type` writes it: int, "bpe" | "unigram", bool | "auto", list[str], ...
    default: Any  # the default value (None: unset)
    meaning: str  # the field's comment(s), one line
    cache: str  # a value of CACHE_CELL


def sections() -> list[tuple[str, type]]:
    """(name, dataclass) of each section of `Config`, in order."""
    return [(f.name, type(getattr(Config(), f.name))) for f in dataclasses.fields(Config)]


def keys() -> list[Key]:
    """Every key of every section, in schema order."""
    out, defaults = [], Config()
    for name, cls in sections():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            out.append(Key(name, f.name, spell_type(hints[f.name]), getattr(getattr(defaults, name), f.name),
                           field_comment(cls, f.name), CACHE_CELL[f.metadata.get("cache", True)]))
    return out


def spell_type(tp: Any) -> str:
    """A type as a user writes its values: ``Literal["a", "b"]`` -> ``"a" | "b"``, None -> none."""
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return " | ".join(toml_value(v) for v in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(spell_type(t) for t in typing.get_args(tp))
    if origin is list:
        inner = spell_type(typing.get_args(tp)[0])
        return f"list[{inner}]"
    return "none" if tp is type(None) else tp.__name__


# -- meanings: the schema's comments ------------------------------------------------------------

def field_comment(cls: type, name: str) -> str:
    """The comment of field `name` of dataclass `cls`, in the class that declares it (a base class
    for inherited fields): the comment lines directly above it, then the comment after its code
    (on any of its lines), as one line; "" when it has none."""
    owner = next(c for c in cls.__mro__ if name in c.__dict__.get("__annotations__", {}))
    return _comments_of(inspect.getsourcefile(owner)).get((owner.__name__, name), "")


@functools.cache
def _comments_of(path: str) -> dict[tuple[str, str], str]:
    """(class name, field name) -> its comment, for every annotated field of every class in `path`."""
    source = Path(path).read_text(encoding="utf-8")
    lines = source.splitlines()
    comments = {tok.start[0]: _text(tok.string)  # line number -> its comment (tokenize: none inside a string)
                for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type == tokenize.COMMENT}
    out = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        for stmt in node.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                above = []
                i = stmt.lineno - 2  # the line above, 0-based
                while i >= 0 and i + 1 in comments and lines[i].lstrip().startswith("#"):
                    above.insert(0, comments[i + 1])
                    i -= 1
                after = [comments[n] for n in range(stmt.lineno, stmt.end_lineno + 1) if n in comments]
                out[(node.name, stmt.target.id)] = " ".join(t for t in above + after if t)
    return out


def _text(comment: str) -> str:
    return comment.lstrip("#").strip()


# -- values as TOML ---------------------------------------------------------------------------

def toml_value(v: Any) -> str:
    """A TOML literal of a config value: bool, int, float, str or a list of them."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return repr(v) if math.isfinite(v) else ("nan" if math.isnan(v) else ("inf" if v > 0 else "-inf"))
    if isinstance(v, str):
        return '"' + "".join(_ESCAPES.get(c, f"\\u{ord(c):04X}" if ord(c) < 0x20 or ord(c) == 0x7F else c)
                             for c in v) + '"'
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    raise TypeError(f"no TOML literal for {type(v).__name__} {v!r}")


_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def to_toml(cfg: Config) -> str:
    """`cfg` as a TOML file (an unset value left out, as `Config.to_dict` does): it loads back
    (`load_config`) into an equal config."""
    out = []
    for section, values in cfg.to_dict().items():
        out.append(f"[{section}]")
        out += [f"{key} = {toml_value(value)}" for key, value in values.items()]
        out.append("")
    return "\n".join(out)


def _default_text(v: Any) -> str:
    return "none" if v is None else toml_value(v)


# -- --help -----------------------------------------------------------------------------------

def help_text(width: int = 100) -> str:
    """Every section and key, its default, type and meaning: the epilog of reproduce_base.py's --help."""
    out = ["config keys: --section.key=value sets one (command line > --config files > these defaults);",
           "a list is comma-separated (--score.splits=test,dev), none unsets (--model.d_k=none).", ""]
    by_section: dict[str, list[Key]] = {}
    for k in keys():
        by_section.setdefault(k.section, []).append(k)
    for name, cls in sections():
        out += textwrap.wrap(f"[{name}] {_paragraphs(cls)[0]}", width, subsequent_indent="    ")
        for k in by_section[name]:
            out.append(f"  --{k.section}.{k.key}={_default_text(k.default)}  ({k.type})")
            out += textwrap.wrap(k.meaning, width, initial_indent=" " * 6, subsequent_indent=" " * 6)
        out.append("")
    return "\n".join(out)


def _paragraphs(cls: type) -> list[str]:
    """A class docstring's paragraphs, each on one line."""
    doc = inspect.getdoc(cls) if cls.__doc__ else ""
    return [" ".join(p.split()) for p in re.split(r"\n\s*\n", doc or "") if p.strip()] or [""]


# -- docs/configuration.md ----------------------------------------------------------------------

def markdown() -> str:
    """docs/configuration.md's key tables: per section, its docstring and a row per key."""
    by_section: dict[str, list[Key]] = {}
    for k in keys():
        by_section.setdefault(k.section, []).append(k)
    out = []
    for name, cls in sections():
        out += [f"### `[{name}]`", "", *(p for para in _paragraphs(cls) for p in (para, "")),
                "| key | default | type | in the cache key | what it is |", "|---|---|---|---|---|"]
        for k in by_section[name]:
            default = "(none)" if k.default is None else f"`{toml_value(k.default)}`"
            out.append(f"| `{k.section}.{k.key}` | {_cell(default)} | {_cell(f'`{k.type}`')} | {k.cache} | "
                       f"{_cell(k.meaning)} |")
        out.append("")
    return "\n".join(out).rstrip("\n") + "\n"


def _cell(text: str) -> str:
    """Text for a Markdown table cell: `|` escaped everywhere (GFM tables), `<` outside code spans
    (so `<work_dir>` is shown, not taken for an HTML tag)."""
    parts = text.split("`")
    return "`".join(p.replace("|", "\\|") if i % 2 else p.replace("|", "\\|").replace("<", "\\<")
                    for i, p in enumerate(parts))


def with_tables(page: str) -> str:
    """`page` with the text between its BEGIN and END markers replaced by `markdown()`."""
    head, sep, rest = page.partition(BEGIN + "\n")
    _, sep2, tail = rest.partition(END)
    if not (sep and sep2):
        raise ValueError(f"{DOC.name}: no '{BEGIN}' ... '{END}' markers")
    return f"{head}{BEGIN}\n\n{markdown()}\n{END}{tail}"


def main(argv: list[str]) -> int:
    if argv == ["--write"]:
        DOC.write_text(with_tables(DOC.read_text(encoding="utf-8")), encoding="utf-8")
        print(f"wrote the key tables of {DOC}")
    elif not argv:
        sys.stdout.write(markdown())
    else:
        print("usage: python -m pipeline.config.reference [--write]", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
