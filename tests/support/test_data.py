"""`make test-data`: the files the data tests read (../shared/data's layout), rebuilt from their public sources.

Every file comes from a public GitHub repository at a pinned commit. The manifest, test_data.json beside this
file, gives for each one the repository, commit, path(s), git blob, the transformation and the sha256 of the
result (its provenance: ../shared/data/PROVENANCE.md, PROVENANCE-enfr.md, multi30k/PROVENANCE.md). Each source
is downloaded from ``https://raw.githubusercontent.com/<repo>/<commit>/<path>`` (``--base-url`` replaces the
host), each result is checked against its pinned sha256, and the layout is written under ``--dest``:
``statmt-mirror/`` (the WMT14 stand-in archives, same member names and order, plus SHA256SUMS of the archives
built here), ``wmt14/`` and ``multi30k/``.

A file already there with its pinned content is not fetched again. Each file is written under a temporary
name and renamed once complete and checked, so an interrupted or failed run leaves nothing that looks done.

    python -m tests.support.test_data --dest .test-data [--base-url URL]

The module also tells the test fixtures where the data is (``data_dir``) and what to say when it is not
(``missing``). It uses the standard library only, so `make test-data` needs no virtual environment.
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip
import hashlib
import io
import json
import os
import sys
import tarfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MANIFEST = Path(__file__).with_name("test_data.json")
# Where the tests look for the data: ../shared/data (the shared checkout's copy), else `make test-data`'s folder.
SHARED = REPO.parent / "shared" / "data"
LOCAL = REPO / ".test-data"
RAW = "https://raw.githubusercontent.com"
MTIME = 1388534400  # 2014-01-01, the stand-in archives' member time
TIMEOUT_S = 60.0


class DataFetchError(RuntimeError):
    """A source that could not be fetched, or a result whose sha256 is not the pinned one."""


def load_manifest() -> dict:
    return json.loads(MANIFEST.read_text(encoding="utf-8"))


def _entries(manifest: dict) -> list[dict]:
    """Every entry that is built from sources: the plain files and the archives' file members."""
    return manifest["files"] + [m for a in manifest["archives"] for m in a["members"] if "from" in m]


def download_bytes(manifest: dict | None = None) -> int:
    """What a first run downloads: the sum of the distinct sources' sizes."""
    manifest = manifest or load_manifest()
    return sum({(s["at"], s["path"]): s["bytes"] for e in _entries(manifest) for s in e["from"]}.values())


def data_dir(var: str, sub: str) -> Path | None:
    """One folder of the test data: ``$var`` where set, else ../shared/data/<sub>, else .test-data/<sub>
    (`make test-data`); None where it is absent."""
    value = os.environ.get(var)
    candidates = [Path(value)] if value else [SHARED / sub, LOCAL / sub]
    return next((p for p in candidates if p.is_dir()), None)


def missing(what: str, var: str) -> str:
    """The skip reason of a test whose data is absent: the command that fetches it."""
    mb = round(download_bytes() / 1e6)
    value = os.environ.get(var)
    looked = f"{var}={value} is not a folder" if value else f"{var} unset, no ../shared/data, no .test-data"
    return (f"{what} absent ({looked}): run `make test-data` (fetches the test data from its public sources, "
            f"~{mb} MB) or set {var}")


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def git_blob(data: bytes) -> str:
    """The git blob id of ``data`` (what `git hash-object` prints)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def gzip_bytes(data: bytes, os_byte: int = 3) -> bytes:
    """gzip as the stand-in has it: level 9, mtime 0, no file name, and ``os_byte`` as the header's OS byte
    (zlib writes its platform's; fixing it keeps the bytes the same everywhere)."""
    out = gzip.compress(data, compresslevel=9, mtime=0)
    return out[:9] + bytes([os_byte]) + out[10:]


def _csv_column(parts: list[bytes], column: str) -> bytes:
    """giga-fren: every row of the first CSV (the corpus head, in order), then the rows of the others that
    are not among the first's (each head row dropped once), in their order; column ``column``, one per line."""
    tables = [list(csv.reader(io.StringIO(part.decode("utf-8"), newline=""))) for part in parts]
    if any(t[0] != tables[0][0] for t in tables):
        raise ValueError(f"the CSV sources' headers differ: {[t[0] for t in tables]}")
    col = tables[0][0].index(column)
    tables = [[tuple(r) for r in t[1:]] for t in tables]
    head = collections.Counter(tables[0])
    out = list(tables[0])
    for row in (r for t in tables[1:] for r in t):
        if head[row]:
            head[row] -= 1
        else:
            out.append(row)
    return "".join(r[col] + "\n" for r in out).encode("utf-8")


def transform(name: str, parts: list[bytes]) -> bytes:
    """The manifest's transformation ``name`` applied to the sources' bytes, in order."""
    if name == "none":
        (data,) = parts
        return data
    if name == "final-newline":
        (data,) = parts
        return data if data.endswith(b"\n") else data + b"\n"
    if name == "concat":
        return b"".join(parts)
    if name.startswith("csv-column:"):
        return _csv_column(parts, name.split(":", 1)[1])
    raise ValueError(f"unknown transformation {name!r}")


def source_url(manifest: dict, src: dict, base_url: str = RAW) -> str:
    at = manifest["repos"][src["at"]]
    return f"{base_url.rstrip('/')}/{at['repo']}/{at['commit']}/{src['path']}"


def fetch_url(url: str, timeout_s: float = TIMEOUT_S, attempts: int = 3) -> bytes:
    """The bytes at ``url``; retries a dropped connection or a 5xx, not a 4xx."""
    for attempt in range(1, attempts + 1):
        try:
            req = urllib.request.Request(url, headers={"User-Agent": "transformer-repro-test-data"})
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                return resp.read()
        except urllib.error.HTTPError as e:
            if e.code < 500 or attempt == attempts:
                raise DataFetchError(f"{url}: HTTP {e.code} {e.reason}") from e
        except (urllib.error.URLError, OSError) as e:
            if attempt == attempts:
                raise DataFetchError(f"{url}: {e}") from e
        time.sleep(attempt)
    raise AssertionError("unreachable")


def write_atomic(path: Path, data: bytes) -> None:
    """``data`` at ``path`` under a temporary name first, renamed when complete."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".part")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _member_key(name: str) -> str:
    """A member name as tarfile reads it back (no trailing slash; ``./`` is ``.``)."""
    return name.rstrip("/") or "."


def _member_sha256(data: bytes, entry: dict) -> str:
    return sha256(gzip.decompress(data) if entry.get("gzip") else data)


def archive_is_done(path: Path, archive: dict) -> bool:
    """Whether ``path`` holds the archive's members, in order, each with its pinned content."""
    if not path.is_file():
        return False
    try:
        with tarfile.open(path) as tar:
            got = [(m.name, m.isdir(), _member_sha256(tar.extractfile(m).read(), e) if m.isfile() else None)
                   for m, e in zip(tar.getmembers(), archive["members"])]
            count = len(tar.getmembers())
    except (tarfile.TarError, OSError, EOFError, gzip.BadGzipFile):
        return False
    want = [(_member_key(e["name"]), bool(e.get("dir")), e.get("sha256")) for e in archive["members"]]
    return count == len(want) and got == want


def archive_bytes(archive: dict, members: dict[str, bytes]) -> bytes:
    """The archive with the stand-in's metadata: GNU tar, uid/gid 0, no owner names, mtime 2014-01-01;
    a ``tgz`` gzipped as ``gzip_bytes`` does with the manifest's OS byte."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for entry in archive["members"]:
            info = tarfile.TarInfo(entry["name"])
            info.mtime, info.uid, info.gid, info.uname, info.gname = MTIME, 0, 0, "", ""
            if entry.get("dir"):
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            else:
                data = members[entry["name"]]
                info.mode, info.size = 0o644, len(data)
                tar.addfile(info, io.BytesIO(data))
    return gzip_bytes(buf.getvalue(), archive["gzip_os"]) if archive["format"] == "tgz" else buf.getvalue()


@dataclass
class Report:
    fetched: list[str] = field(default_factory=list)  # the source URLs downloaded
    fetched_bytes: int = 0
    written: list[str] = field(default_factory=list)  # the files (re)built, relative to the destination
    present: list[str] = field(default_factory=list)  # the files already there with their pinned content
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


class Builder:
    """One run: what is missing, its sources fetched once each (in parallel), each result checked and written."""

    def __init__(self, dest: Path, base_url: str = RAW, timeout_s: float = TIMEOUT_S, workers: int = 8):
        self.dest, self.base_url, self.timeout_s, self.workers = Path(dest), base_url, timeout_s, workers
        self.manifest = load_manifest()
        self.report = Report()
        self.sources: dict[str, bytes | DataFetchError] = {}

    def url(self, src: dict) -> str:
        return source_url(self.manifest, src, self.base_url)

    def run(self) -> Report:
        files = [f for f in self.manifest["files"] if not self._present(f["dest"], f["sha256"])]
        archives = [a for a in self.manifest["archives"] if not self._archive_present(a)]
        wanted = files + [m for a in archives for m in a["members"] if "from" in m]
        self._fetch_all([self.url(s) for e in wanted for s in e["from"]])
        for f in files:
            data = self._result(f["dest"], f)
            if data is not None:
                write_atomic(self.dest / f["dest"], data)
                self.report.written.append(f["dest"])
        for a in archives:
            self._build_archive(a)
        if not self.report.errors:
            self._write_sums()
        return self.report

    def _present(self, rel: str, want: str) -> bool:
        path = self.dest / rel
        done = path.is_file() and sha256(path.read_bytes()) == want
        if done:
            self.report.present.append(rel)
        return done

    def _archive_present(self, archive: dict) -> bool:
        done = archive_is_done(self.dest / archive["dest"], archive)
        if done:
            self.report.present.append(archive["dest"])
        return done

    def _fetch_all(self, urls: list[str]) -> None:
        todo = list(dict.fromkeys(u for u in urls if u not in self.sources))

        def one(url: str) -> bytes | DataFetchError:
            try:
                return fetch_url(url, self.timeout_s)
            except DataFetchError as e:
                return e

        with ThreadPoolExecutor(max_workers=self.workers) as pool:
            for url, got in zip(todo, pool.map(one, todo)):
                self.sources[url] = got
                if isinstance(got, bytes):
                    self.report.fetched.append(url)
                    self.report.fetched_bytes += len(got)

    def _result(self, name: str, entry: dict) -> bytes | None:
        """The checked bytes of one entry, or None with the reason in the report's errors."""
        got = [self.sources[self.url(s)] for s in entry["from"]]
        failed = [str(g) for g in got if isinstance(g, DataFetchError)]
        if failed:
            self.report.errors.append(f"{name}: cannot fetch its source: {'; '.join(failed)}")
            return None
        data = transform(entry["transform"], got)
        if sha256(data) != entry["sha256"]:
            urls = ", ".join(self.url(s) for s in entry["from"])
            blobs = "".join(f"; {self.url(s)} is git blob {git_blob(g)}, not the pinned {s['blob']}"
                            for s, g in zip(entry["from"], got) if git_blob(g) != s["blob"])
            self.report.errors.append(f"{name}: sha256 {sha256(data)} is not the pinned {entry['sha256']} "
                                      f"(built from {urls}{blobs})")
            return None
        return data

    def _build_archive(self, archive: dict) -> None:
        members: dict[str, bytes] = {}
        for entry in (m for m in archive["members"] if "from" in m):
            data = self._result(f"{archive['dest']}:{entry['name']}", entry)
            if data is None:
                continue
            if entry.get("gzip"):
                data = gzip_bytes(data)
                if sha256(data) != entry["gz_sha256"]:
                    # Another zlib may deflate the same text to other bytes; the text is the checked one.
                    self.report.warnings.append(f"{archive['dest']}:{entry['name']}: this zlib's gzip bytes "
                                                f"differ from the stand-in's (the text is identical)")
            members[entry["name"]] = data
        if len(members) == sum("from" in m for m in archive["members"]):
            data = archive_bytes(archive, members)
            if sha256(data) != archive["sha256"]:
                self.report.warnings.append(f"{archive['dest']}: this zlib's bytes differ from the stand-in's "
                                            f"(the members are identical)")
            write_atomic(self.dest / archive["dest"], data)
            self.report.written.append(archive["dest"])

    def _write_sums(self) -> None:
        """statmt-mirror/SHA256SUMS: the checksums of the archives as built here (sha256sum's format)."""
        root = self.dest / "statmt-mirror"
        rels = sorted(str(Path(a["dest"]).relative_to("statmt-mirror")) for a in self.manifest["archives"])
        text = "".join(f"{sha256((root / r).read_bytes())}  ./{r}\n" for r in rels)
        path = root / "SHA256SUMS"
        if not path.is_file() or path.read_text() != text:
            write_atomic(path, text.encode())
            self.report.written.append("statmt-mirror/SHA256SUMS")


def build(dest: Path, base_url: str = RAW, timeout_s: float = TIMEOUT_S) -> Report:
    """Build (or complete) the test data under ``dest``; raises DataFetchError listing every failure."""
    report = Builder(dest, base_url, timeout_s).run()
    if report.errors:
        raise DataFetchError("test data: " + "\n".join(report.errors))
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.support.test_data", description=__doc__.split("\n\n")[0])
    ap.add_argument("--dest", type=Path, required=True, help="the folder to build (e.g. .test-data)")
    ap.add_argument("--base-url", default=RAW, help=f"replaces {RAW} (a mirror with <repo>/<commit>/<path>)")
    ap.add_argument("--timeout", type=float, default=TIMEOUT_S, help="seconds per request")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    print(f"test data: {len(load_manifest()['files'])} files and the WMT14 stand-in archives from their public "
          f"sources (~{download_bytes() / 1e6:.0f} MB on a first run) into {args.dest}", flush=True)
    try:
        report = build(args.dest, args.base_url, args.timeout)
    except DataFetchError as e:
        print(e, file=sys.stderr)
        return 1
    for w in report.warnings:
        print(f"warning: {w}", file=sys.stderr)
    print(f"test data: {len(report.written)} files written, {len(report.present)} already there; "
          f"{len(report.fetched)} sources fetched ({report.fetched_bytes / 1e6:.1f} MB) "
          f"in {time.monotonic() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
