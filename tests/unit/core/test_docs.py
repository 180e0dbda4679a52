"""The README is the front page and docs/ holds the rest; these tests keep the two true.

- The README stays a front page (at most README_MAX_LINES lines), names the test command CI runs
  and lists every deviation from the paper; every page of docs/ is linked from it.
- Every relative link and image in README.md and docs/*.md resolves: the file exists, and a
  `#fragment` names a heading of that page (GitHub's anchors).
- Every `make TARGET` the pages name is a target of the Makefile.
- docs/configuration.md names every key of the config schema, with its default, and its key tables
  are the ones `python -m pipeline.config.reference --write` generates from the schema; every key
  has a meaning (its field's comment).
- docs/architecture.md's map of the tree ("Every file, by folder") names every package and module
  of the product (model/, pipeline/, workflows/) and every benchmark script, and every file it
  names exists. A module added without a line in the map, or a line left for a module that moved,
  fails.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
PRODUCT = ("model", "pipeline", "workflows")
README_MAX_LINES = 320
MAP_PAGE = REPO / "docs" / "architecture.md"
MAP_HEADING = "## Every file, by folder"


def _pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def _prose(text: str) -> str:
    """The text outside fenced code blocks (a `# comment` in a shell block is not a heading, a
    `[x](y)` in a code block is not a link)."""
    return "\n".join(part for i, part in enumerate(re.split(r"^```.*$", text, flags=re.M)) if i % 2 == 0)


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in _prose(path.read_text(encoding="utf-8")).splitlines():
        m = re.match(r"#{1,6} (.*)", line)
        if m:
            a = _anchor(m.group(1))
            n = seen.get(a, 0)
            seen[a] = n + 1
            out.add(a if n == 0 else f"{a}-{n}")
    return out


def _links(path: Path) -> list[str]:
    """The targets of its Markdown links and images, outside code."""
    return re.findall(r"\]\(([^)\s]+)\)", _prose(path.read_text(encoding="utf-8")))


# -- the front page ---------------------------------------------------------------------------

def test_readme_is_a_front_page():
    n = len((REPO / "README.md").read_text(encoding="utf-8").splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines (at most {README_MAX_LINES}): move details to docs/"


def test_readme_states_the_test_command_ci_runs():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    assert re.search(r"^make test$", ci, flags=re.M), ".ci/run no longer calls `make test`"
    assert "CI runs `make test`" in readme
    assert re.search(r"^make test\b", _readme_code(readme), flags=re.M)


def _readme_code(text: str) -> str:
    return "\n".join(part for i, part in enumerate(re.split(r"^```.*$", text, flags=re.M)) if i % 2 == 1)


def test_readme_lists_the_deviations():
    """STYLE.md: every deviation from the paper is listed in the README (a table of where, what, why)."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    section = readme.split("\n## What is paper-faithful, and every deviation\n", 1)
    assert len(section) == 2, "README.md has no 'What is paper-faithful, and every deviation' section"
    rows = [line for line in section[1].split("\n## ", 1)[0].splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| where | deviation | why |"), rows[:1]
    where = {row.split("|")[1].strip() for row in rows[1:]}
    assert {"data", "model", "loss", "train", "search", "score"} <= where, where
    assert len(rows) - 1 >= 20, f"{len(rows) - 1} deviations listed"


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(REPO / t.split("#", 1)[0]).resolve() for t in _links(REPO / "README.md") if not t.startswith(("http", "#"))}
    unlinked = [p.name for p in sorted((REPO / "docs").glob("*.md")) if p.resolve() not in linked]
    assert not unlinked, f"docs pages the README does not link: {unlinked}"


# -- links, images, make targets --------------------------------------------------------------

@pytest.mark.parametrize("page", _pages(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_links_and_images_resolve(page: Path):
    broken = []
    for target in _links(page):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        file, _, fragment = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            broken.append(f"{target} (no file {dest.relative_to(REPO) if dest.is_relative_to(REPO) else dest})")
        elif fragment and dest.suffix == ".md" and fragment not in _anchors(dest):
            broken.append(f"{target} (no heading #{fragment} in {dest.name})")
    assert not broken, f"{page.relative_to(REPO)}: {broken}"


def test_every_make_target_named_exists():
    makefile = (REPO / "Makefile").read_text(encoding="utf-8")
    targets = set(re.findall(r"^([A-Za-z0-9_-]+):", makefile, flags=re.M))
    named = {t for page in _pages() for t in re.findall(r"`make ([a-z0-9-]+)", page.read_text(encoding="utf-8"))}
    named |= {t for page in _pages() for t in re.findall(r"^make ([a-z0-9-]+)", page.read_text(encoding="utf-8"), flags=re.M)}
    assert named, "no `make` command found in the pages"
    assert named <= targets, f"make targets the pages name but the Makefile lacks: {sorted(named - targets)}"


# -- every config key -------------------------------------------------------------------------

def _key_rows() -> dict[str, str]:
    """`section.key` -> its default cell, from docs/configuration.md's key tables."""
    text = (REPO / "docs" / "configuration.md").read_text(encoding="utf-8")
    return {m.group(1): m.group(2).strip() for m in re.finditer(r"^\| `([a-z_]+\.[a-z0-9_]+)` \| ([^|]*)\|", text, flags=re.M)}


def _default_cell(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        v = f.default
    elif f.default_factory is not dataclasses.MISSING:
        v = f.default_factory()
    else:
        return "(required)"
    if v is None:
        return "(none)"
    if isinstance(v, bool):
        return f"`{str(v).lower()}`"
    if isinstance(v, str):
        return f'`"{v}"`'
    if isinstance(v, list):
        return "`[" + ", ".join(f'"{x}"' if isinstance(x, str) else str(x) for x in v) + "]`"
    if isinstance(v, float) and v == int(v) and abs(v) >= 1e4:
        return f"`{v:g}`"
    return f"`{v!r}`"


def test_configuration_page_names_every_key_with_its_default():
    from pipeline.config.schema import Config

    rows = _key_rows()
    missing, wrong, schema_keys = [], [], set()
    for section in dataclasses.fields(Config):
        for f in dataclasses.fields(section.default_factory()):
            key = f"{section.name}.{f.name}"
            schema_keys.add(key)
            if key not in rows:
                missing.append(key)
            elif rows[key] != _default_cell(f):
                wrong.append(f"{key}: page {rows[key]}, schema {_default_cell(f)}")
    assert not missing, f"docs/configuration.md does not list: {missing}"
    assert not wrong, f"docs/configuration.md has stale defaults: {wrong}"
    assert not set(rows) - schema_keys, f"docs/configuration.md lists keys the schema lacks: {sorted(set(rows) - schema_keys)}"


def test_configuration_key_tables_are_generated_from_the_schema():
    from pipeline.config import reference

    page = (REPO / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert reference.BEGIN in page and reference.END in page, "docs/configuration.md lost its generated-table markers"
    assert page == reference.with_tables(page), \
        "docs/configuration.md's key tables differ from the schema: run `python -m pipeline.config.reference --write`"


def test_every_config_key_has_a_meaning():
    """The comment above or beside each schema field is what --help and docs/configuration.md show."""
    from pipeline.config import reference

    bare = [f"{k.section}.{k.key}" for k in reference.keys() if not k.meaning]
    assert not bare, f"schema fields without a comment (their meaning in --help and the docs): {bare}"


# -- the map of the tree ----------------------------------------------------------------------

def _layout() -> str:
    page = MAP_PAGE.read_text(encoding="utf-8")
    section = page.split(f"\n{MAP_HEADING}\n", 1)[1].split("\n## ", 1)[0]
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
    assert not missing, f"docs/architecture.md '{MAP_HEADING[3:]}' does not name: {missing}"


def test_every_file_the_map_names_exists():
    entries = _lines_by_folder(_layout())
    gone = []
    for folder, text in entries.items():
        if not folder.endswith("/") or not (REPO / folder).is_dir():
            continue
        for name in re.findall(r"([A-Za-z_][A-Za-z0-9_-]*\.(?:py|sh|toml|md))", text):
            if not list((REPO / folder).rglob(name)):
                gone.append(f"{folder}{name}")
    assert not gone, f"docs/architecture.md '{MAP_HEADING[3:]}' names files that do not exist: {gone}"


def test_every_folder_of_the_product_has_an_entry():
    entries = _lines_by_folder(_layout())
    folders = {f"{p.relative_to(REPO).as_posix()}/" for root in PRODUCT for p in [REPO / root, *(REPO / root).rglob("*")]
               if p.is_dir() and "__pycache__" not in p.parts and (p / "__init__.py").exists()}
    # config/ and tracking/ are small subpackages of the core, listed inside pipeline/'s entry
    nested = {f for f in folders if f not in entries and f.rsplit("/", 2)[0] + "/" in entries
              and f.rstrip("/").rsplit("/", 1)[1] + "/" in entries[f.rsplit("/", 2)[0] + "/"]}
    assert folders - nested <= set(entries), sorted(folders - nested - set(entries))
