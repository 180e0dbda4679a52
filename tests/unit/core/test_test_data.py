"""`make test-data` (tests/support/test_data.py) against a fake raw.githubusercontent.com on 127.0.0.1.

The fake serves ``<repo>/<commit>/<path>`` with the sources rebuilt from the test data's own files (each
transformation reversed: a joined file cut at its parts' line counts, a missing final newline taken off, the
giga-fren CSVs written back from the two gzipped columns), so the script's whole path runs: the download, the
transformations, the sha256 checks, the archives and SHA256SUMS. What it builds must equal the data the tests
read: every plain file byte for byte, every archive's members (names, order, bytes).
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import http.server
import io
import shutil
import tarfile
from pathlib import Path

import pytest

from pipeline.data import sources
from pipeline.data.fetch import extract_members, fetch
from tests.support import test_data
from tests.support.http import serve

# The three folders of the data, as the fixtures find them (tests/conftest.py).
PARTS = {"statmt-mirror": "WMT14_MIRROR", "wmt14": "WMT14_DATA", "multi30k": "MULTI30K_MIRROR"}


def _data_root() -> dict[str, Path]:
    found = {sub: test_data.data_dir(var, sub) for sub, var in PARTS.items()}
    absent = [sub for sub, path in found.items() if path is None]
    if absent:
        pytest.skip(test_data.missing(f"the test data ({', '.join(absent)})", PARTS[absent[0]]))
    return found


def _read(root: dict[str, Path], rel: str) -> bytes:
    sub, _, rest = rel.partition("/")
    return (root[sub] / rest).read_bytes()


def _members(path: Path) -> list[tuple[str, bool, bytes | None]]:
    with tarfile.open(path) as tar:
        return [(m.name, m.isdir(), tar.extractfile(m).read() if m.isfile() else None) for m in tar.getmembers()]


def _results(manifest: dict, root: dict[str, Path]) -> dict[str, bytes]:
    """Every built entry's bytes as the data has them: "dest" for a file, "dest:member" for a member (a gzip
    member's text)."""
    out = {f["dest"]: _read(root, f["dest"]) for f in manifest["files"]}
    for a in manifest["archives"]:
        sub, _, rest = a["dest"].partition("/")
        got = {name: data for name, _, data in _members(root[sub] / rest)}
        for m in (m for m in a["members"] if "from" in m):
            data = got[m["name"].rstrip("/")]
            out[f"{a['dest']}:{m['name']}"] = gzip.decompress(data) if m.get("gzip") else data
    return out


def _split(entry: dict, data: bytes) -> list[bytes]:
    """The sources of one entry, cut back out of its bytes (not for the CSV columns: see _csv_sources)."""
    if entry["transform"] == "none":
        return [data]
    if entry["transform"] == "final-newline":
        assert data.endswith(b"\n")
        return [data[:-1]]
    assert entry["transform"] == "concat", entry["transform"]
    lines, parts, start = data.splitlines(keepends=True), [], 0  # bytes.splitlines: \n, \r only
    for src in entry["from"]:
        parts.append(b"".join(lines[start:start + src["lines"]]))
        start += src["lines"]
    assert start == len(lines)
    return parts


def _csv_sources(columns: dict[str, bytes], sources_: list[dict]) -> list[bytes]:
    """giga-fren's CSVs from its columns: the head rows in the first; the rest in the second; the head rows
    again in the third (the script drops them there, as in the real split files)."""
    # split at "\n" only: str.splitlines would also cut at U+0085, U+2028 (in the text)
    rows = list(zip(*(text.decode("utf-8").removesuffix("\n").split("\n") for text in columns.values())))
    head = sources_[0]["rows"]

    def table(body: list[tuple[str, ...]]) -> bytes:
        buf = io.StringIO()
        csv.writer(buf, lineterminator="\n").writerows([tuple(columns), *body])
        return buf.getvalue().encode("utf-8")

    return [table(rows[:head]), table(rows[head:]), table(rows[:head][::-1])]


def served_files(manifest: dict, root: dict[str, Path]) -> dict[str, bytes]:
    """URL path (``/<repo>/<commit>/<path>``) -> the bytes the fake serves."""
    results = _results(manifest, root)
    entries = manifest["files"] + [dict(m, dest=f"{a['dest']}:{m['name']}") for a in manifest["archives"]
                                   for m in a["members"] if "from" in m]
    out: dict[str, bytes] = {}
    csv_columns: dict[tuple, dict[str, bytes]] = {}  # the CSV sources -> {column: its text}
    for e in entries:
        if e["transform"].startswith("csv-column:"):
            key = tuple(_path(manifest, s) for s in e["from"])
            csv_columns.setdefault(key, {})[e["transform"].split(":", 1)[1]] = results[e["dest"]]
            continue
        for src, part in zip(e["from"], _split(e, results[e["dest"]])):
            out.setdefault(_path(manifest, src), part)
    for e in (e for e in entries if e["transform"].startswith("csv-column:")):
        key = tuple(_path(manifest, s) for s in e["from"])
        out.update(zip(key, _csv_sources(csv_columns[key], e["from"])))
    return out


def _path(manifest: dict, src: dict) -> str:
    return test_data.source_url(manifest, src, base_url="")


class FakeRaw:
    """The fake raw.githubusercontent.com: its files, the paths asked for, and bytes to serve instead."""

    def __init__(self, files: dict[str, bytes]):
        self.files, self.requests, self.override = files, [], {}

    def handler(self):
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep test output quiet
                pass

            def do_GET(self):
                fake.requests.append(self.path)
                body = fake.override.get(self.path, fake.files.get(self.path))
                if body is None:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        return Handler


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The script run once against the fake into a fresh folder: (folder, report, fake, base URL, data)."""
    root = _data_root()
    manifest = test_data.load_manifest()
    fake = FakeRaw(served_files(manifest, root))
    dest = tmp_path_factory.mktemp("test-data")
    with serve(fake.handler()) as url:
        report = test_data.build(dest, base_url=url)
        yield dest, report, fake, url, root


def test_every_file_is_the_data_byte_for_byte(built):
    dest, report, fake, _, root = built
    manifest = test_data.load_manifest()
    for f in manifest["files"]:
        assert (dest / f["dest"]).read_bytes() == _read(root, f["dest"]), f["dest"]
    # every source once, and the sizes the skip messages quote
    assert len(fake.requests) == len(set(fake.requests)) == len(report.fetched)
    assert report.fetched_bytes == test_data.download_bytes(manifest)
    assert not list(dest.rglob("*.part"))


def test_every_archive_holds_the_data_members_in_order(built):
    dest, _, _, _, root = built
    for a in test_data.load_manifest()["archives"]:
        sub, _, rest = a["dest"].partition("/")
        assert _members(dest / a["dest"]) == _members(root[sub] / rest), a["dest"]
        # tgz or plain tar, as the original
        assert ((dest / a["dest"]).read_bytes()[:2] == b"\x1f\x8b") == (a["format"] == "tgz"), a["dest"]


def test_sha256sums_are_those_of_the_built_archives(built):
    dest = built[0]
    mirror = dest / "statmt-mirror"
    sums = sources.parse_sha256sums((mirror / "SHA256SUMS").read_text())
    archives = sorted(Path(a["dest"]).relative_to("statmt-mirror").as_posix()
                      for a in test_data.load_manifest()["archives"])
    assert sorted(sums) == archives
    for rel, sha in sums.items():
        assert hashlib.sha256((mirror / rel).read_bytes()).hexdigest() == sha, rel


def test_a_second_run_fetches_nothing(built):
    dest, _, fake, url, _ = built
    before = len(fake.requests)
    report = test_data.build(dest, base_url=url)
    assert len(fake.requests) == before and not report.fetched and not report.written
    manifest = test_data.load_manifest()
    assert len(report.present) == len(manifest["files"]) + len(manifest["archives"])


def test_a_corrupted_source_fails_naming_it_and_leaves_nothing_that_looks_done(built, tmp_path):
    dest, _, fake, url, _ = built
    manifest = test_data.load_manifest()
    copy = tmp_path / "copy"
    shutil.copytree(dest, copy)
    # newstest2013.en is a plain file and a member of dev.tgz: both must be refused
    (copy / "wmt14/newstest2013.en").unlink()
    (copy / "statmt-mirror/wmt14/dev.tgz").unlink()
    entry = next(f for f in manifest["files"] if f["dest"] == "wmt14/newstest2013.en")
    path = _path(manifest, entry["from"][0])
    bad = fake.files[path].replace(b"Obama", b"0bama", 1)
    fake.override[path] = bad
    before = len(fake.requests)
    try:
        with pytest.raises(test_data.DataFetchError) as err:
            test_data.build(copy, base_url=url)
    finally:
        fake.override.clear()
    msg = str(err.value)
    got = hashlib.sha256(bad).hexdigest()
    assert f"wmt14/newstest2013.en: sha256 {got} is not the pinned {entry['sha256']}" in msg
    assert "statmt-mirror/wmt14/dev.tgz:./dev/newstest2013.en: sha256" in msg and f"{url}{path}" in msg
    assert f"is git blob {test_data.git_blob(bad)}, not the pinned {entry['from'][0]['blob']}" in msg
    # only the sources of the two missing files were fetched, each once
    dev = next(a for a in manifest["archives"] if a["dest"] == "statmt-mirror/wmt14/dev.tgz")
    needed = {path} | {_path(manifest, s) for m in dev["members"] for s in m.get("from", [])}
    assert sorted(fake.requests[before:]) == sorted(needed)
    assert not (copy / "wmt14/newstest2013.en").exists() and not (copy / "statmt-mirror/wmt14/dev.tgz").exists()
    assert not list(copy.rglob("*.part"))
    # the right bytes again: the run completes, fetching those sources only
    report = test_data.build(copy, base_url=url)
    assert sorted(report.fetched) == sorted(f"{url}{p}" for p in needed)
    assert sorted(report.written) == ["statmt-mirror/wmt14/dev.tgz", "wmt14/newstest2013.en"]
    assert (copy / "wmt14/newstest2013.en").read_bytes() == (dest / "wmt14/newstest2013.en").read_bytes()


def test_a_half_written_file_is_not_taken_as_done(built, tmp_path):
    """A file cut short (a run killed while writing it, before writes were atomic, or a full disk) is rebuilt."""
    dest, _, _, url, _ = built
    copy = tmp_path / "copy"
    shutil.copytree(dest, copy)
    cut = ["wmt14/newstest2014.de", "statmt-mirror/wmt13/training-parallel-un.tgz"]
    for rel in cut:
        data = (copy / rel).read_bytes()
        (copy / rel).write_bytes(data[: len(data) // 2])
    report = test_data.build(copy, base_url=url)
    assert sorted(report.written) == sorted(cut)
    for rel in cut:
        assert (copy / rel).read_bytes() == (dest / rel).read_bytes(), rel


def test_an_unreachable_source_is_an_error_naming_its_url(tmp_path):
    manifest = test_data.load_manifest()
    with serve(FakeRaw({}).handler()) as url:
        report = test_data.Builder(tmp_path, base_url=url).run()
    first = manifest["files"][0]
    assert any(e.startswith(f"{first['dest']}: cannot fetch its source: {url}{_path(manifest, first['from'][0])}: "
                            "HTTP 404") for e in report.errors)
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]


def test_the_pipeline_reads_the_built_mirror(built, tmp_path):
    """The download stage's own code on the built mirror: each archive of both registries verified against
    the mirror's SHA256SUMS, each member extracted; the Multi30k files carry the registry's sha256."""
    dest = built[0]
    mirror = dest / "statmt-mirror"
    sums = sources.parse_sha256sums((mirror / "SHA256SUMS").read_text())
    for corpora in (sources.wmt14("en", "de"), sources.wmt14("en", "fr")):
        for archive in sources.archives(corpora):
            uri = sources.location(archive, str(mirror))
            local, _, _ = fetch(uri, str(tmp_path), 10.0, sha256=sums[archive.relpath])
            wanted = {m: str(tmp_path / "out" / m.replace("/", "_")) for c in corpora if c.archive == archive
                      for m in c.members.values()}
            assert set(extract_members(local, archive.relpath, wanted)) == set(wanted)
    for pair in sources.multi30k("en", "de"):
        for f in pair.files.values():
            fetch(sources.location(f, str(dest / "multi30k")), str(tmp_path), 10.0, sha256=f.sha256)
