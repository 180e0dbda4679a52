"""One code path for local paths, NFS mounts and object stores (``s3://``, ``gs://``).

Every stage reads and writes through these helpers (pyarrow file systems underneath), so a work
dir on S3 and one on local disk behave the same. Credentials and endpoints come from the
environment (``AWS_ACCESS_KEY_ID``, ``AWS_ENDPOINT_URL``, ...), never from config files.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any, BinaryIO

import pyarrow.fs as pafs

REMOTE_SCHEMES = ("s3://", "gs://", "gcs://", "hdfs://", "abfs://")


def is_remote(uri: str) -> bool:
    return uri.startswith(REMOTE_SCHEMES)


def absolute(uri: str) -> str:
    """Local paths become absolute (Ray workers run in other directories); URIs are kept."""
    if is_remote(uri):
        return uri.rstrip("/")
    if uri.startswith("file://"):
        uri = uri[len("file://"):]
    return str(Path(uri).expanduser().resolve())


def join(base: str, *parts: str) -> str:
    out = base.rstrip("/")
    for p in parts:
        out = f"{out}/{p.strip('/')}"
    return out


# What pyarrow's S3/GCS file systems read from the environment: a cached file system is reused
# only while these are unchanged (tests switch endpoints; a driver may switch credentials).
_FS_ENV = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
           "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_REGION", "AWS_DEFAULT_REGION",
           "GOOGLE_APPLICATION_CREDENTIALS", "STORAGE_EMULATOR_HOST")


def resolve(uri: str) -> tuple[pafs.FileSystem, str]:
    """(file system, path inside it) for a local path or a URI.

    ``s3://`` and ``gs://`` file systems are cached per bucket: ``FileSystem.from_uri`` builds a
    new client (and, on AWS, asks for the bucket's region) on every call, ~40 ms each.
    Endpoint and credentials come from the environment (``AWS_ENDPOINT_URL[_S3]``, ...).
    """
    if not is_remote(uri):
        return pafs.LocalFileSystem(), absolute(uri)
    scheme, rest = uri.split("://", 1)
    bucket, _, key = rest.partition("/")
    if scheme in ("s3", "gs", "gcs") and bucket and not any(c in rest for c in "@?"):
        fs = _bucket_fs(scheme, bucket, tuple(os.environ.get(k, "") for k in _FS_ENV))
        return fs, f"{bucket}/{key}".rstrip("/")
    return pafs.FileSystem.from_uri(uri)


@functools.lru_cache(maxsize=64)
def _bucket_fs(scheme: str, bucket: str, env: tuple[str, ...]) -> pafs.FileSystem:
    return pafs.FileSystem.from_uri(f"{scheme}://{bucket}")[0]


def exists(uri: str) -> bool:
    fs, path = resolve(uri)
    return fs.get_file_info(path).type != pafs.FileType.NotFound


def makedirs(uri: str) -> None:
    fs, path = resolve(uri)
    fs.create_dir(path, recursive=True)


def rmtree(uri: str) -> None:
    fs, path = resolve(uri)
    info = fs.get_file_info(path)
    if info.type == pafs.FileType.Directory:
        fs.delete_dir(path)
    elif info.type == pafs.FileType.File:
        fs.delete_file(path)


def open_input(uri: str, compression: str | None = "detect") -> BinaryIO:
    """A read stream. pyarrow's default ``compression="detect"`` transparently gunzips ``*.gz``
    (by extension); pass ``compression=None`` for the raw bytes (checksums, archives)."""
    fs, path = resolve(uri)
    return fs.open_input_stream(path, compression=compression)


def open_output(uri: str, compression: str | None = "detect") -> BinaryIO:
    """A write stream. Like ``open_input``, pyarrow's ``"detect"`` gzips ``*.gz`` (by extension);
    pass ``compression=None`` to write bytes that are already compressed (an archive's ``.gz`` member)."""
    fs, path = resolve(uri)
    parent = path.rsplit("/", 1)[0]
    if parent:
        fs.create_dir(parent, recursive=True)
    return fs.open_output_stream(path, compression=compression)


def read_bytes(uri: str) -> bytes:
    with open_input(uri) as f:
        return f.read()


def write_bytes(uri: str, data: bytes) -> None:
    """Write a whole file so that readers see the old state or the new one, never half of it.

    Local: temp file + rename. Object stores: a single PUT is already all-or-nothing.
    """
    if is_remote(uri):
        with open_output(uri) as f:
            f.write(data)
        return
    path = Path(absolute(uri))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def read_text(uri: str) -> str:
    return read_bytes(uri).decode("utf-8")


def write_text(uri: str, text: str) -> None:
    write_bytes(uri, text.encode("utf-8"))


def read_json(uri: str) -> Any:
    return json.loads(read_text(uri))


def write_json(uri: str, obj: Any) -> None:
    write_text(uri, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def list_files(uri: str) -> list[tuple[str, int]]:
    """All files below ``uri`` as (path relative to uri, size in bytes), sorted."""
    fs, path = resolve(uri)
    if fs.get_file_info(path).type != pafs.FileType.Directory:
        return []
    infos = fs.get_file_info(pafs.FileSelector(path, recursive=True))
    base = path.rstrip("/") + "/"
    return sorted((i.path[len(base):], i.size) for i in infos if i.type == pafs.FileType.File)


def shard_uris(dir_uri: str) -> list[str]:
    """The Parquet shards (``part-*.parquet``) of a split folder, sorted by name: shard order,
    which is the split's row order. The one listing of shards: encode, vocab and train use it."""
    return [join(dir_uri, name) for name, _ in list_files(dir_uri)
            if name.startswith("part-") and name.endswith(".parquet") and "/" not in name]


def last_modified(uri: str) -> float | None:
    """When anything below ``uri`` last changed (epoch seconds): the newest file's mtime, or the
    folder's own when it holds no file; None when ``uri`` does not exist."""
    fs, path = resolve(uri)
    info = fs.get_file_info(path)
    if info.type == pafs.FileType.NotFound:
        return None
    infos = [info]
    if info.type == pafs.FileType.Directory:
        infos += [i for i in fs.get_file_info(pafs.FileSelector(path, recursive=True))
                  if i.type == pafs.FileType.File]
    times = [i.mtime.timestamp() for i in infos if i.mtime is not None]
    return max(times) if times else None


def sha256(uri: str, chunk_bytes: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open_input(uri, compression=None) as f:  # the stored bytes, even for *.gz
        for chunk in iter(lambda: f.read(chunk_bytes), b""):
            h.update(chunk)
    return h.hexdigest()


def upload(local_path: str | Path, uri: str) -> None:
    """Copy a local file or folder to ``uri`` (a local destination is replaced atomically per file)."""
    local_path = Path(local_path)
    if local_path.is_dir():
        for p in sorted(local_path.rglob("*")):
            if p.is_file():
                upload(p, join(uri, p.relative_to(local_path).as_posix()))
        return
    if is_remote(uri):
        fs, path = resolve(uri)
        pafs.copy_files(str(local_path), path, source_filesystem=pafs.LocalFileSystem(),
                        destination_filesystem=fs)
    else:
        dest = Path(absolute(uri))
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex}.tmp")
        shutil.copyfile(local_path, tmp)
        os.replace(tmp, dest)


def local_copy(uri: str, cache_dir: str | Path | None = None) -> Path:
    """A local path with the content of ``uri``: the path itself when local, else a download."""
    if not is_remote(uri):
        return Path(absolute(uri))
    fs, path = resolve(uri)
    info = fs.get_file_info(path)
    if info.type == pafs.FileType.NotFound:
        raise FileNotFoundError(f"{uri}: no such file or folder")
    # The cache key covers what is there now (sizes, mtimes): a rewritten object (a forced rerun
    # writes the same URIs) is downloaded again, never served stale.
    cache_dir = Path(cache_dir or tempfile.gettempdir()) / "transformer-repro-cache"
    key = hashlib.sha256(f"{uri}\n{_fingerprint(fs, info)}".encode()).hexdigest()[:16]
    dest = cache_dir / key / uri.rstrip("/").rsplit("/", 1)[-1]
    if dest.exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    if info.type == pafs.FileType.Directory:
        tmp = Path(tempfile.mkdtemp(dir=dest.parent))
        pafs.copy_files(path, str(tmp), source_filesystem=fs, destination_filesystem=pafs.LocalFileSystem())
    else:
        tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex}.tmp")
        pafs.copy_files(path, str(tmp), source_filesystem=fs, destination_filesystem=pafs.LocalFileSystem())
    os.replace(tmp, dest)
    return dest


def fingerprint(uri: str) -> str:
    """What is at ``uri`` now (paths, sizes, mtimes of every file below it): a cache key part."""
    fs, path = resolve(uri)
    return _fingerprint(fs, fs.get_file_info(path))


def _fingerprint(fs: pafs.FileSystem, info: pafs.FileInfo) -> str:
    infos = [info]
    if info.type == pafs.FileType.Directory:
        infos = [i for i in fs.get_file_info(pafs.FileSelector(info.path, recursive=True))
                 if i.type == pafs.FileType.File]
    return ";".join(f"{i.path}:{i.size}:{i.mtime_ns}" for i in sorted(infos, key=lambda i: i.path))


class StorageAccessError(OSError):
    """A work dir or storage path cannot be reached, read or written; the message says why."""


def check_access(uri: str, write: bool = True) -> None:
    """Fail fast, before any stage runs, when ``uri`` cannot be listed (or, with ``write``, written).

    Object-store errors come back from pyarrow as a bare ``OSError``; this names the endpoint, the
    bucket, what went wrong (no such bucket, refused credentials, no answer) and what to check.
    """
    probe = join(absolute(uri), f".write_probe-{uuid.uuid4().hex[:8]}")
    try:
        fs, path = resolve(uri)
        fs.get_file_info(path)
        if write:
            write_text(probe, "ok")
            rmtree(probe)
    except OSError as e:
        raise StorageAccessError(describe_error(uri, e, "write to" if write else "read")) from e


def describe_error(uri: str, error: BaseException, action: str = "use") -> str:
    """A message for a failed access to ``uri``: where it went, the likely cause, what to check."""
    raw = " ".join(str(error).split())
    if not is_remote(uri):
        return f"cannot {action} {uri} ({raw}); check the path and its permissions"
    scheme, rest = uri.split("://", 1)
    bucket = rest.split("/", 1)[0]
    where = f"bucket '{bucket}'"
    if scheme == "s3":
        endpoint = next((f"{os.environ[k]} (from {k})" for k in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
                         if os.environ.get(k)), "AWS S3 (no AWS_ENDPOINT_URL set)")
        where += f" at {endpoint}"
        creds = ("AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN)" if
                 os.environ.get("AWS_ACCESS_KEY_ID") else
                 "AWS_ACCESS_KEY_ID is not set, so AWS_PROFILE / ~/.aws / the instance role is used")
    else:
        creds = "GOOGLE_APPLICATION_CREDENTIALS or the instance's service account"
    hint = _cause(raw, bucket, creds)
    return f"cannot {action} {uri} ({where}): {hint} [{raw}]"


_NO_BUCKET = ("NO_SUCH_BUCKET", "NOSUCHBUCKET", "BUCKET DOES NOT EXIST")
_REFUSED = ("ACCESS_DENIED", "ACCESSDENIED", "INVALID_ACCESS_KEY", "SIGNATURE", "FORBIDDEN", "CREDENTIAL",
            "EXPIRED", "PERMISSION_DENIED", "UNAUTHENTICATED")
_NO_ANSWER = ("NETWORK_CONNECTION", "COULD NOT CONNECT", "RESOLVE HOST", "TIMED OUT", "TIMEOUT", "CURLCODE",
              "UNAVAILABLE")


def _cause(raw: str, bucket: str, creds: str) -> str:
    """The likely cause of an object-store error, from the store's error code where it gives one.

    The code (``AWS Error NETWORK_CONNECTION``) decides before any keyword in the free text, and the
    text is searched without the bucket and key names and with numbers matched whole: a port such
    as 40365 once read as HTTP 403, and a bucket may be called ``credentials``.
    """
    code = re.search(r"AWS Error ([A-Z_]+)", raw)
    text = re.sub(r"(bucket|key) '[^']*'", r"\1", raw).upper()
    no_bucket = "the bucket does not exist: create it or fix the bucket name in the URI"
    if f"BUCKET '{bucket.upper()}' NOT FOUND" in raw.upper():  # GCS names the bucket in its message
        return no_bucket
    for where in ([code.group(1)] if code and code.group(1) != "UNKNOWN" else []) + [text]:
        if any(s in where for s in _NO_ANSWER):
            return ("the object store does not answer: check the endpoint (AWS_ENDPOINT_URL or "
                    "AWS_ENDPOINT_URL_S3 for an S3-compatible store) and the network")
        if any(s in where for s in _NO_BUCKET):
            return no_bucket
        if any(s in where for s in _REFUSED) or re.search(r"(?<![\d.:])40[13](?![\d.])", where):
            return f"the credentials were refused or lack permission on this bucket: check {creds}"
    return f"check the bucket name, the endpoint (AWS_ENDPOINT_URL) and {creds}"
