"""Encoded Parquet shards -> flat numpy arrays for the training loop (pyarrow, no Ray).

Loader choice: every worker reads the shards itself with pyarrow and keeps the two id columns as
flat int32 arrays + offsets (WMT14 train: ~4.5M pairs, ~1.1 GB). Batches are then plain index
gathers (`pipeline.train.batching.collate`), so:
- the batch plan is global and deterministic (seed, epoch), identical on every worker, and
  independent of the number of workers: no shuffle service, no per-worker shard assignment;
- resume is exact: a data position is (epoch, step index in the epoch), nothing to replay;
- no extra actors: Ray Data's streaming executor would add a pipeline of tasks/actors beside the
  training workers (on a 2-core box they starve each other) and cannot resume mid-epoch.
Measured in `benchmarks/train_bench.py`: gathering micro-batches costs a small fraction of the
model step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from pipeline import storage

log = logging.getLogger(__name__)

ID_COLUMNS = ("src_ids", "tgt_ids")


def shard_files(dir_uri: str) -> list[str]:
    """The Parquet shards of a split folder, sorted by name (the row order of the split)."""
    fs, path = storage.resolve(dir_uri)
    info = fs.get_file_info(path)
    if info.type != pafs.FileType.Directory:
        raise FileNotFoundError(f"{dir_uri}: not a folder of Parquet shards")
    infos = fs.get_file_info(pafs.FileSelector(path, recursive=False))
    return sorted(i.path for i in infos if i.type == pafs.FileType.File and i.path.endswith(".parquet"))


def _filesystem(dir_uri: str) -> pafs.FileSystem:
    return storage.resolve(dir_uri)[0]


@dataclass
class Corpus:
    """A split's id lists, flattened: pair i's source is src_values[src_offsets[i]:src_offsets[i+1]]."""

    src_values: np.ndarray  # int32 pieces, all rows concatenated
    src_offsets: np.ndarray  # int64 (num_rows + 1,)
    tgt_values: np.ndarray
    tgt_offsets: np.ndarray

    @property
    def num_rows(self) -> int:
        return len(self.src_offsets) - 1

    @property
    def src_len(self) -> np.ndarray:
        return np.diff(self.src_offsets)

    @property
    def tgt_len(self) -> np.ndarray:
        return np.diff(self.tgt_offsets)


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
        return Corpus(empty, np.zeros(1, np.int64), empty, np.zeros(1, np.int64))
    table = pa.concat_tables(tables)
    src_values, src_offsets = _flat(table.column("src_ids"))
    tgt_values, tgt_offsets = _flat(table.column("tgt_ids"))
    return Corpus(src_values, src_offsets, tgt_values, tgt_offsets)


def load_lengths(dir_uri: str) -> tuple[np.ndarray, np.ndarray]:
    """(src_len, tgt_len) of every row, in shard order, from the small length columns only."""
    files = shard_files(dir_uri)
    fs = _filesystem(dir_uri)
    src, tgt = [], []
    for f in files:
        t = pq.read_table(f, columns=["src_len", "tgt_len"], filesystem=fs)
        src.append(t.column("src_len").to_numpy().astype(np.int64))
        tgt.append(t.column("tgt_len").to_numpy().astype(np.int64))
    if not files:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(src), np.concatenate(tgt)


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
