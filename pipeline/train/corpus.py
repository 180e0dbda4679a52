"""Encoded Parquet shards -> flat id arrays for the training loop (pyarrow + numpy, no Ray).

Loader choice: every worker indexes the two id columns as flat int32 arrays + offsets (WMT14
EN-DE: ~4.5M pairs, ~1.1 GB; EN-FR: ~36M pairs, ~9 GB). Batches are plain index gathers
(`pipeline.train.feeder.collate`), so:
- the batch plan is global and deterministic (seed, epoch), identical on every worker, and
  independent of the number of workers: no shuffle service, no per-worker shard assignment;
- resume is exact: a data position is (epoch, step index in the epoch), nothing to replay;
- no extra actors: Ray Data's streaming executor would add a pipeline of tasks/actors beside the
  training workers (on a 2-core box they starve each other) and cannot resume mid-epoch.

One copy per node (`load_shared_corpus`): the first worker on a node converts the shards, one at
a time, into .npy files under a node-local cache folder (keyed by the split's URI and the shards'
sizes and mtimes, written to a temp folder and renamed, under a file lock); every worker of the
node, a replaced one or a resumed run included, then memory-maps the same files read-only. The
page cache holds one copy; each worker's private memory is O(rows) (the kept-row index and the
epoch plan), not O(tokens).
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import mmap
import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from pipeline import storage

log = logging.getLogger(__name__)

ID_COLUMNS = ("src_ids", "tgt_ids")


def shard_files(dir_uri: str) -> list[str]:
    """The shards of a split folder (`storage.shard_uris`), as paths in its file system."""
    fs, path = storage.resolve(dir_uri)
    if fs.get_file_info(path).type != pafs.FileType.Directory:
        raise FileNotFoundError(f"{dir_uri}: not a folder of Parquet shards")
    return [storage.resolve(uri)[1] for uri in storage.shard_uris(dir_uri)]


def _filesystem(dir_uri: str) -> pafs.FileSystem:
    return storage.resolve(dir_uri)[0]


@dataclass(kw_only=True)
class Corpus:
    """A split's id lists, flattened: pair i's source is src_values[src_offsets[i]:src_offsets[i+1]]."""

    src_values: np.ndarray  # int32 pieces, all rows concatenated
    src_offsets: np.ndarray  # int64 (num_rows + 1,)
    tgt_values: np.ndarray
    tgt_offsets: np.ndarray
    # Pieces per row (int32), computed once: a per-step np.diff over the whole corpus costs more
    # than a GPU step at WMT sizes (docs/benchmarks.md, scale_bench).
    src_len: np.ndarray = field(default=None)  # type: ignore[assignment]
    tgt_len: np.ndarray = field(default=None)  # type: ignore[assignment]
    files: dict[str, Path] | None = None  # the mapped .npy file of each array (shared copy only)

    def __post_init__(self) -> None:
        if self.src_len is None:
            self.src_len = np.diff(self.src_offsets).astype(np.int32)
        if self.tgt_len is None:
            self.tgt_len = np.diff(self.tgt_offsets).astype(np.int32)

    @property
    def num_rows(self) -> int:
        return len(self.src_offsets) - 1


def _flat(column: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    arr = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    if arr.null_count:
        raise ValueError("null id list in an encoded shard")
    offsets = arr.offsets.to_numpy().astype(np.int64)
    values = arr.flatten().to_numpy(zero_copy_only=False).astype(np.int32, copy=False)
    return values, offsets - offsets[0]


def load_corpus(dir_uri: str) -> Corpus:
    """Read the id columns of every shard of a split (in shard order) into one `Corpus`."""
    files = shard_files(dir_uri)
    fs = _filesystem(dir_uri)
    tables = [pq.read_table(f, columns=list(ID_COLUMNS), filesystem=fs) for f in files]
    if not tables:
        empty = np.zeros(0, np.int32)
        return Corpus(src_values=empty, src_offsets=np.zeros(1, np.int64), tgt_values=empty,
                      tgt_offsets=np.zeros(1, np.int64))
    table = pa.concat_tables(tables)
    src_values, src_offsets = _flat(table.column("src_ids"))
    tgt_values, tgt_offsets = _flat(table.column("tgt_ids"))
    return Corpus(src_values=src_values, src_offsets=src_offsets, tgt_values=tgt_values, tgt_offsets=tgt_offsets)


_ARRAYS = ("src_values", "src_offsets", "tgt_values", "tgt_offsets", "src_len", "tgt_len")


def default_cache_dir() -> Path:
    """Node-local folder for shared corpus copies (`workers.corpus_cache_dir` overrides it)."""
    return Path(tempfile.gettempdir()) / "transformer-repro" / "corpus"


def load_shared_corpus(dir_uri: str, cache_dir: str | Path | None = None) -> Corpus:
    """The split as read-only memory maps of one node-local copy, written by the first caller.

    Concurrent callers on a node wait on a file lock while one writes; later ones (other
    workers, a replaced worker, a resumed run) map the finished copy at once.
    """
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    key = hashlib.sha256(f"{storage.absolute(dir_uri)}\n{storage.fingerprint(dir_uri)}".encode()).hexdigest()[:20]
    folder = root / key
    if not (folder / "DONE").exists():
        root.mkdir(parents=True, exist_ok=True)
        with open(root / f"{key}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if we die
            if not (folder / "DONE").exists():
                _write_copy(dir_uri, folder)
    arrays = {name: _map_npy(folder / f"{name}.npy") for name in _ARRAYS}
    return Corpus(**arrays, files={name: folder / f"{name}.npy" for name in _ARRAYS})


def _map_npy(path: Path) -> np.ndarray:
    """A read-only ndarray over a shared, pre-populated memory map of an .npy file.

    MAP_POPULATE maps every page at start-up (from the page cache, which the node's first worker
    filled): a step's random rows then never page-fault. Faulting on demand costs time every step at
    WMT sizes, most of it in the prefetch thread, whose faults hold the GIL the training thread
    needs (docs/benchmarks.md, scale_bench). A plain ndarray, not np.memmap, whose indexing costs
    more per step."""
    with open(path, "rb") as f:
        version = np.lib.format.read_magic(f)
        read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                       else np.lib.format.read_array_header_2_0)
        shape, fortran, dtype = read_header(f)
        offset = f.tell()
        if fortran or dtype.hasobject:
            raise ValueError(f"{path}: not a C-ordered numeric array")
        count = int(np.prod(shape))
        if count == 0:
            return np.zeros(shape, dtype)
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        mm = mmap.mmap(f.fileno(), offset + count * dtype.itemsize, flags=flags, prot=mmap.PROT_READ)
    return np.frombuffer(mm, dtype=dtype, count=count, offset=offset).reshape(shape)


def _write_copy(dir_uri: str, folder: Path) -> None:
    """Convert the shards into .npy files, then publish them (rename of a finished temp folder).

    Shards are converted in parallel threads (pyarrow's reads release the GIL), each into its
    own slice of the memory-mapped outputs: memory is one shard per thread, and a 36M-pair
    split converts in well under a minute on a few cores."""
    t0 = time.perf_counter()
    files, fs = shard_files(dir_uri), _filesystem(dir_uri)
    threads = max(1, min(4, os.cpu_count() or 1, len(files)))
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        with ThreadPoolExecutor(threads, thread_name_prefix="corpus-copy") as pool:
            pairs = _convert(files, fs, pool, tmp)
        _evict_stale(folder.parent, dir_uri)
        (tmp / "DONE").write_text(f"{dir_uri}\n")
        if folder.exists():  # a copy left half-written by a killed writer (no DONE file)
            shutil.rmtree(folder)
        os.replace(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("corpus: %d pairs of %s copied to %s in %.1f s (%d threads; shared by this node's workers)",
             pairs, dir_uri, folder, time.perf_counter() - t0, threads)


def _convert(files: list[str], fs: pafs.FileSystem, pool: ThreadPoolExecutor, tmp: Path) -> int:
    """The shards' lengths, offsets and flat ids as .npy files in `tmp`, a shard per task of `pool`;
    the number of pairs."""
    lengths = list(pool.map(lambda f: _shard_lengths(f, fs), files))
    src_len = np.concatenate([a for a, _ in lengths]) if files else np.zeros(0, np.int64)
    tgt_len = np.concatenate([b for _, b in lengths]) if files else np.zeros(0, np.int64)
    out = {"src_len": src_len.astype(np.int32), "tgt_len": tgt_len.astype(np.int32)}
    for side, lens in (("src", src_len), ("tgt", tgt_len)):
        offsets = np.zeros(len(lens) + 1, np.int64)
        np.cumsum(lens, out=offsets[1:])
        out[f"{side}_offsets"] = offsets
    for name, arr in out.items():
        np.save(tmp / f"{name}.npy", arr)
    values = {side: np.lib.format.open_memmap(tmp / f"{side}_values.npy", mode="w+", dtype=np.int32,
                                              shape=(int(out[f"{side}_offsets"][-1]),))
              for side in ("src", "tgt")}
    # Where each shard's pieces start in the flat arrays, per side.
    starts = {side: np.concatenate([[0], np.cumsum([int(l[j].sum()) for l in lengths])])
              for j, side in enumerate(("src", "tgt"))}

    def convert(k: int) -> None:
        table = pq.read_table(files[k], columns=list(ID_COLUMNS), filesystem=fs)
        for side in ("src", "tgt"):
            flat, _ = _flat(table.column(f"{side}_ids"))
            lo, hi = int(starts[side][k]), int(starts[side][k + 1])
            if len(flat) != hi - lo:
                raise ValueError(f"{files[k]}: the {side}_len column disagrees with {side}_ids "
                                 f"({hi - lo} vs {len(flat)} pieces): re-encode this split")
            values[side][lo:hi] = flat

    list(pool.map(convert, range(len(files))))
    for arr in values.values():
        arr.flush()
    return len(src_len)


def _shard_lengths(path: str, fs: pafs.FileSystem) -> tuple[np.ndarray, np.ndarray]:
    t = pq.read_table(path, columns=["src_len", "tgt_len"], filesystem=fs)
    return t.column("src_len").to_numpy().astype(np.int64), t.column("tgt_len").to_numpy().astype(np.int64)


def _evict_stale(root: Path, dir_uri: str) -> None:
    """Remove older copies of this split (its shards changed since) and copies of local splits
    that no longer exist, so the cache does not grow with every rerun. A worker still mapping a
    removed copy keeps reading it (unlinked files live until unmapped)."""
    for done in root.glob("*/DONE"):
        uri = done.read_text().strip()
        gone = not storage.is_remote(uri) and not Path(storage.absolute(uri)).exists()
        if uri == dir_uri or gone:
            shutil.rmtree(done.parent, ignore_errors=True)


def load_lengths(dir_uri: str) -> tuple[np.ndarray, np.ndarray]:
    """(src_len, tgt_len) of every row, in shard order, from the small length columns only."""
    files = shard_files(dir_uri)
    fs = _filesystem(dir_uri)
    if not files:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    lengths = [_shard_lengths(f, fs) for f in files]
    return np.concatenate([a for a, _ in lengths]), np.concatenate([b for _, b in lengths])


def id_range(dir_uri: str) -> tuple[int, int] | None:
    """(min, max) id over both id columns of a split; None when it holds no ids.

    Reads the Parquet column statistics (footer only) where every row group has them, and
    computes min/max over the column otherwise.
    """
    fs = _filesystem(dir_uri)
    lo, hi = None, None
    for f in shard_files(dir_uri):
        pf = pq.ParquetFile(f, filesystem=fs)
        md = pf.metadata
        for name in ID_COLUMNS:
            leaf = f"{name}.list.element"
            stats = []
            for rg in range(md.num_row_groups):
                cols = [md.row_group(rg).column(j) for j in range(md.row_group(rg).num_columns)]
                col = next((c for c in cols if c.path_in_schema == leaf), None)
                if col is None:
                    raise ValueError(f"{f}: no column {name} (list<int32>) in an encoded shard")
                if col.num_values == 0:
                    continue
                s = col.statistics
                stats.append((s.min, s.max) if s is not None and s.has_min_max else None)
            if any(s is None for s in stats):
                mm = pc.min_max(pc.list_flatten(pf.read(columns=[name]).column(name))).as_py()
                stats = [(mm["min"], mm["max"])] if mm["min"] is not None else []
            for s_lo, s_hi in stats:
                lo = s_lo if lo is None else min(lo, s_lo)
                hi = s_hi if hi is None else max(hi, s_hi)
    return None if lo is None else (int(lo), int(hi))
