"""One code path for local paths, NFS mounts and object stores (``s3://``, ``gs://``).

Every stage reads and writes through these helpers (pyarrow file systems underneath), so a work
dir on S3 and one on local disk behave the same. Credentials and endpoints come from the
environment (``AWS_ACCESS_KEY_ID``, ``AWS_ENDPOINT_URL``, ...), never from config files.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any, BinaryIO, Iterator

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


def resolve(uri: str) -> tuple[pafs.FileSystem, str]:
    """(file system, path inside it) for a local path or a URI."""
    if is_remote(uri):
        return pafs.FileSystem.from_uri(uri)
    return pafs.LocalFileSystem(), absolute(uri)


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


def open_input(uri: str) -> BinaryIO:
    fs, path = resolve(uri)
    return fs.open_input_stream(path)


def open_output(uri: str) -> BinaryIO:
    fs, path = resolve(uri)
    parent = path.rsplit("/", 1)[0]
    if parent:
        fs.create_dir(parent, recursive=True)
    return fs.open_output_stream(path)


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


def sha256(uri: str, chunk_bytes: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open_input(uri) as f:
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
    cache_dir = Path(cache_dir or tempfile.gettempdir()) / "transformer-repro-cache"
    dest = cache_dir / hashlib.sha256(uri.encode()).hexdigest()[:16] / uri.rstrip("/").rsplit("/", 1)[-1]
    if dest.exists():
        return dest
    fs, path = resolve(uri)
    dest.parent.mkdir(parents=True, exist_ok=True)
    if fs.get_file_info(path).type == pafs.FileType.Directory:
        tmp = Path(tempfile.mkdtemp(dir=dest.parent))
        pafs.copy_files(path, str(tmp), source_filesystem=fs, destination_filesystem=pafs.LocalFileSystem())
    else:
        tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex}.tmp")
        pafs.copy_files(path, str(tmp), source_filesystem=fs, destination_filesystem=pafs.LocalFileSystem())
    os.replace(tmp, dest)
    return dest


def iter_lines(uri: str) -> Iterator[str]:
    """Lines of a UTF-8 text file (without the newline); invalid UTF-8 raises naming the file."""
    import io

    with open_input(uri) as raw:
        text = io.TextIOWrapper(raw, encoding="utf-8", newline="\n")
        lineno = 0
        try:
            for lineno, line in enumerate(text, 1):
                yield line.rstrip("\n").rstrip("\r")
        except UnicodeDecodeError as e:
            raise ValueError(f"{uri}: invalid UTF-8 after line {lineno}: {e}") from e
