"""Getting bytes: resumable HTTP downloads, checksums, and tar extraction through ``pipeline.storage``.

An HTTP download goes to ``<cache>/<hash of url>/<name>.part`` and is renamed only once it is
complete (its length matches the server's) and its checksum (when one is known) matches, so a
failed or partial download never counts as done; the next attempt resumes it with a Range request.
Local folders and ``s3://`` URIs are read in place, never copied first.
"""

from __future__ import annotations

import gzip
import hashlib
import http.client
import logging
import os
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
import zlib
from pathlib import Path
from typing import BinaryIO

from pipeline import storage

log = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20
PROGRESS_INTERVAL_S = 5.0
RETRY_BASE_S = 2.0  # backoff before retry k: RETRY_BASE_S * 2**(k-1), at most 30 s


class DataError(RuntimeError):
    """Bad input data (checksum, archive, alignment, encoding): the message names the file."""


class ChecksumError(DataError):
    pass


def is_http(uri: str) -> bool:
    return uri.startswith(("http://", "https://"))


def cache_dir(work_dir: str) -> Path:
    """Where HTTP downloads (and their ``.part`` files) live between runs.

    ``$TRANSFORMER_REPRO_CACHE`` if set; else ``<work_dir>/_cache/download`` for a local work dir;
    else a folder in the system temp dir (a remote work dir cannot hold a seekable partial file).
    """
    if os.environ.get("TRANSFORMER_REPRO_CACHE"):
        return Path(os.environ["TRANSFORMER_REPRO_CACHE"]) / "download"
    if not storage.is_remote(work_dir):
        return Path(storage.absolute(work_dir)) / "_cache" / "download"
    return Path(tempfile.gettempdir()) / "transformer-repro-cache" / "download"


class Progress:
    """Logs ``name: done/total MB (pct), MB/s`` at most every few seconds, and once at the end."""

    def __init__(self, name: str, total: int | None = None, start: int = 0):
        self.name, self.total, self.done = name, total, start
        self._t0 = self._last = time.monotonic()
        self._start = start

    def update(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if now - self._last >= PROGRESS_INTERVAL_S:
            self._last = now
            log.info("%s", self.line())

    def line(self) -> str:
        rate = (self.done - self._start) / max(time.monotonic() - self._t0, 1e-9) / 1e6
        if self.total:
            return (f"{self.name}: {self.done / 1e6:.1f}/{self.total / 1e6:.1f} MB "
                    f"({100 * self.done / self.total:.0f}%), {rate:.1f} MB/s")
        return f"{self.name}: {self.done / 1e6:.1f} MB, {rate:.1f} MB/s"


def copy_stream(src: BinaryIO, dst: BinaryIO, progress: Progress | None = None) -> int:
    n = 0
    for chunk in iter(lambda: src.read(CHUNK_BYTES), b""):
        dst.write(chunk)
        n += len(chunk)
        if progress:
            progress.update(len(chunk))
    return n


def hashes(uri: str) -> tuple[str, str, int]:
    """(md5, sha256, size) of a local path or storage URI, in one streaming pass."""
    md5, sha = hashlib.md5(), hashlib.sha256()
    size = 0
    with storage.open_input(uri, compression=None) as f:
        for chunk in iter(lambda: f.read(CHUNK_BYTES), b""):
            md5.update(chunk)
            sha.update(chunk)
            size += len(chunk)
    return md5.hexdigest(), sha.hexdigest(), size


def verify(uri: str, name: str, sha256: str | None = None, md5: str | None = None) -> tuple[str, int]:
    """Check ``uri`` against the expected hash (sha256 preferred); return (sha256, size)."""
    got_md5, got_sha, size = hashes(uri)
    if sha256 and got_sha != sha256.lower():
        raise ChecksumError(f"checksum mismatch for {name} ({uri}): expected sha256 {sha256.lower()}, got {got_sha}")
    if not sha256 and md5 and got_md5 != md5.lower():
        raise ChecksumError(f"checksum mismatch for {name} ({uri}): expected md5 {md5.lower()}, got {got_md5}")
    return got_sha, size


def read_small(uri: str, timeout_s: float) -> bytes | None:
    """A small file (e.g. ``SHA256SUMS``) from a URL or storage URI; None if it is not there."""
    if is_http(uri):
        try:
            with urllib.request.urlopen(uri, timeout=timeout_s) as resp:
                return resp.read()
        except urllib.error.HTTPError as e:
            if e.code in (403, 404, 410):
                return None
            raise
    if not storage.exists(uri):
        return None
    with storage.open_input(uri, compression=None) as f:
        return f.read()


def http_download(url: str, dest: Path, timeout_s: float, attempts: int = 5) -> Path:
    """Download ``url`` to ``dest`` through ``dest.part``, resuming it with HTTP Range requests."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    last_error: Exception | None = None
    for attempt in range(1, attempts + 1):
        have = part.stat().st_size if part.exists() else 0
        headers = {"Range": f"bytes={have}-"} if have else {}
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout_s) as resp:
                content_range = resp.headers.get("Content-Range", "")
                if have and (resp.status != 206 or not content_range.startswith(f"bytes {have}-")):
                    log.info("%s: the server does not resume here, restarting", url)
                    have = 0  # it sent the whole file (or another range): start over
                length = resp.headers.get("Content-Length")
                total = have + int(length) if length is not None else None
                if have:
                    log.info("%s: resuming at %.1f MB", url, have / 1e6)
                with part.open("ab" if have else "wb") as f:
                    progress = Progress(url, total, start=have)
                    copy_stream(resp, f, progress)
                    log.info("%s", progress.line())
            size = part.stat().st_size
            if total is not None and size != total:
                raise DataError(f"{url}: got {size} of {total} bytes")
            os.replace(part, dest)
            return dest
        except urllib.error.HTTPError as e:
            if e.code == 416 and have:  # asked past the end: complete already, or a different file
                content_range = e.headers.get("Content-Range", "")
                if content_range.endswith(f"/{have}"):
                    os.replace(part, dest)
                    return dest
                part.unlink(missing_ok=True)
                last_error = e
                continue
            if e.code in (401, 403, 404, 410):
                raise DataError(f"cannot download {url}: HTTP {e.code} {e.reason}") from e
            last_error = e
        except (urllib.error.URLError, http.client.HTTPException, OSError, DataError) as e:
            last_error = e
        if attempt == attempts:
            break
        wait_s = min(RETRY_BASE_S * 2 ** (attempt - 1), 30.0)
        log.warning("%s: attempt %d/%d failed (%s); retrying in %.0fs", url, attempt, attempts, last_error, wait_s)
        time.sleep(wait_s)
    raise DataError(f"cannot download {url} after {attempts} attempts: {last_error}")


def fetch(uri: str, work_dir: str, timeout_s: float, sha256: str | None = None,
          md5: str | None = None) -> tuple[str, str, int]:
    """Make ``uri`` readable through storage and verify it: (readable uri, sha256, size).

    HTTP(S) is downloaded into the cache (a finished, verified file there is reused); a local path
    or ``s3://`` URI is verified in place.
    """
    name = uri.rstrip("/").rsplit("/", 1)[-1]
    if not is_http(uri):
        if not storage.exists(uri):
            raise DataError(f"{name}: no such file {uri}")
        got, size = verify(uri, name, sha256, md5)
        return uri, got, size
    dest = cache_dir(work_dir) / hashlib.sha256(uri.encode()).hexdigest()[:16] / name
    if dest.exists():
        try:
            got, size = verify(str(dest), name, sha256, md5)
            log.info("%s: using the cached download %s", uri, dest)
            return str(dest), got, size
        except ChecksumError:
            log.warning("%s: cached copy %s does not match its checksum; downloading again", uri, dest)
            dest.unlink()
    http_download(uri, dest, timeout_s)
    try:
        got, size = verify(str(dest), name, sha256, md5)
    except ChecksumError:
        dest.unlink()  # never keep a file that failed its check: it would look done next time
        raise
    return str(dest), got, size


def _member_name(name: str) -> str:
    while name.startswith("./"):
        name = name[2:]
    return name


def extract_members(archive_uri: str, name: str, wanted: dict[str, str]) -> dict[str, int]:
    """Stream the tar(.gz) at ``archive_uri`` once and copy the members ``wanted`` (member -> uri).
    A ``.gz`` member wanted under a name without ``.gz`` is decompressed on the way.

    Returns bytes written per member. Raises ``DataError`` naming the archive when it is not a
    tar archive or lacks a wanted member.
    """
    written: dict[str, int] = {}
    seen: list[str] = []
    try:
        with storage.open_input(archive_uri, compression=None) as raw, tarfile.open(fileobj=raw, mode="r|*") as tar:
            for member in tar:
                m = _member_name(member.name)
                seen.append(m)
                if m not in wanted or not member.isfile():
                    continue
                src = tar.extractfile(member)
                if m.endswith(".gz") and not wanted[m].endswith(".gz"):
                    src = gzip.GzipFile(fileobj=src)  # Giga's gzip members, wanted as plain (seekable) text
                # Otherwise the member's bytes as they are (no second gzip layer for a ``.gz`` name).
                with storage.open_output(wanted[m], compression=None) as dst:
                    written[m] = copy_stream(src, dst, Progress(f"{name}:{m}", member.size))
                log.info("extracted %s from %s (%.1f MB)", m, name, written[m] / 1e6)
                if len(written) == len(wanted):
                    break
    except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile) as e:
        raise DataError(f"{name} ({archive_uri}) is not a valid tar archive: {e}") from e
    missing = sorted(set(wanted) - set(written))
    if missing:
        raise DataError(f"{name} ({archive_uri}) lacks {missing}; it holds {seen[:10]}")
    return written


def copy_text_file(src_uri: str, dest_uri: str) -> int:
    """Copy a (possibly ``.gz``) text file to ``dest_uri``, decompressed; returns bytes written."""
    name = src_uri.rstrip("/").rsplit("/", 1)[-1]
    try:
        with storage.open_input(src_uri, compression=None) as raw:
            src = gzip.GzipFile(fileobj=raw) if src_uri.endswith(".gz") else raw
            with storage.open_output(dest_uri) as dst:
                return copy_stream(src, dst, Progress(name))
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:
        raise DataError(f"{src_uri} is not a valid gzip file: {e}") from e
