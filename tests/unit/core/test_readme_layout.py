"""The README's Layout section is the map of the tree: every package and module of the product
(model/, pipeline/, workflows/) and every benchmark script is named there, and every file it names
exists. A module added without a line in the map, or a line left for a module that moved, fails."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
PRODUCT = ("model", "pipeline", "workflows")


def _layout() -> str:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    section = readme.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    return section.split("```", 2)[1]


def _lines_by_folder(block: str) -> dict[str, str]:
    """'pipeline/train/' -> the text of its entry (its first line and the indented lines after it)."""
    entries: dict[str, str] = {}
    folder = None
    for line in block.splitlines():
        if line and not line[0].isspace():
            folder, _, text = line.partition(" ")
            entries[folder] = text
        elif folder is not None:
            entries[folder] += " " + line.strip()
    return entries


def _names(text: str) -> set[str]:
    return set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", text))


def test_every_product_module_and_benchmark_is_on_the_map():
    entries = _lines_by_folder(_layout())
    missing = []
    for root in PRODUCT:
        for path in sorted((REPO / root).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            rel = path.relative_to(REPO)
            if path.name == "__init__.py":
                continue
            folder = f"{rel.parent.as_posix()}/"
            parent = f"{rel.parent.parent.as_posix()}/"
            # a module is named in its folder's entry; a subpackage (config/, tracking/) may be
            # listed with its modules inside its parent's entry
            own = entries.get(folder)
            if own is not None and path.stem in _names(own):
                continue
            if folder not in entries and parent in entries and path.stem in _names(entries[parent]) \
                    and f"{rel.parent.name}/" in entries[parent]:
                continue
            missing.append(str(rel))
    bench = _names(entries.get("benchmarks/", ""))
    missing += [f"benchmarks/{p.name}" for p in sorted((REPO / "benchmarks").glob("*.py")) if p.stem not in bench]
    missing += [f"benchmarks/{p.name}" for p in sorted((REPO / "benchmarks").glob("*.sh"))
                if p.name not in entries.get("benchmarks/", "")]
    assert not missing, f"README 'Layout' does not name: {missing}"


def test_every_file_the_map_names_exists():
    entries = _lines_by_folder(_layout())
    gone = []
    for folder, text in entries.items():
        if not folder.endswith("/") or not (REPO / folder).is_dir():
            continue
        for name in re.findall(r"([A-Za-z_][A-Za-z0-9_-]*\.(?:py|sh|toml|md))", text):
            if not list((REPO / folder).rglob(name)):
                gone.append(f"{folder}{name}")
    assert not gone, f"README 'Layout' names files that do not exist: {gone}"


def test_every_folder_of_the_product_has_an_entry():
    entries = _lines_by_folder(_layout())
    folders = {f"{p.relative_to(REPO).as_posix()}/" for root in PRODUCT for p in [REPO / root, *(REPO / root).rglob("*")]
               if p.is_dir() and "__pycache__" not in p.parts and (p / "__init__.py").exists()}
    # config/ and tracking/ are small subpackages of the core, listed inside pipeline/'s entry
    nested = {f for f in folders if f not in entries and f.rsplit("/", 2)[0] + "/" in entries
              and f.rstrip("/").rsplit("/", 1)[1] + "/" in entries[f.rsplit("/", 2)[0] + "/"]}
    assert folders - nested <= set(entries), sorted(folders - nested - set(entries))
