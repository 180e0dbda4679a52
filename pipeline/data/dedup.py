"""Exact-duplicate removal for ``prepare`` (``data.dedup``): first occurrence wins, O(n), bounded memory.

Pairs are compared by a 64-bit hash (``clean.pair_hashes``, computed in the parallel cleaning
tasks). Every kept pair has a position (its order in the split's merge order). The driver streams
(hash, position) into ``NUM_BUCKETS`` spill files by the hash's top bits, a bounded buffer at a
time; then each bucket alone is sorted by (hash, position): equal neighbours after the first are
the duplicates. Memory: one bucket (16 bytes per pair in it: n / 256 pairs) plus 8 bytes per
*duplicate* found, never a structure of all n hashes; time: one pass plus a sort per bucket.
(The chance of a false duplicate, two pairs with the same hash, is ~n^2 / 2^65: 4e-5 for 36M.)
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import numpy as np

NUM_BUCKETS = 256  # 36M pairs (WMT14 EN-FR) -> ~140k per bucket, 2.2 MB when sorted
BUFFER_PAIRS = 1 << 20  # (hash, position) pairs held before they are appended to the spill files
ENTRY = np.dtype([("hash", "<u8"), ("pos", "<u8")])


class Deduper:
    """Feed each chunk's hashes in merge order (``add``), then ask for the duplicates' positions."""

    def __init__(self, num_buckets: int = NUM_BUCKETS, buffer_pairs: int = BUFFER_PAIRS):
        if num_buckets < 1 or num_buckets & (num_buckets - 1):
            raise ValueError(f"num_buckets must be a power of two, got {num_buckets}")
        self.num_buckets, self.buffer_pairs = num_buckets, buffer_pairs
        self.bits = (num_buckets - 1).bit_length()  # a bucket = the hash's top `bits` bits
        self.dir = Path(tempfile.mkdtemp(prefix="transformer-repro-dedup-"))
        self.num_pairs = 0
        self._buffer: list[np.ndarray] = []
        self._buffered = 0

    def add(self, hashes: np.ndarray) -> None:
        """The hashes of the next ``len(hashes)`` pairs (positions ``num_pairs ..``)."""
        entries = np.empty(len(hashes), dtype=ENTRY)
        entries["hash"] = hashes
        entries["pos"] = np.arange(self.num_pairs, self.num_pairs + len(hashes), dtype=np.uint64)
        self.num_pairs += len(hashes)
        self._buffer.append(entries)
        self._buffered += len(entries)
        if self._buffered >= self.buffer_pairs:
            self._spill()

    def _spill(self) -> None:
        if not self._buffer:
            return
        entries = np.concatenate(self._buffer)
        self._buffer, self._buffered = [], 0
        bucket = (entries["hash"] >> np.uint64(64 - self.bits)).astype(np.int64) if self.bits else \
            np.zeros(len(entries), dtype=np.int64)
        order = np.argsort(bucket, kind="stable")
        entries, bucket = entries[order], bucket[order]
        bounds = np.searchsorted(bucket, np.arange(self.num_buckets + 1))
        for b in np.flatnonzero(np.diff(bounds)):
            with open(self.dir / f"{b:04d}.bin", "ab") as f:
                entries[bounds[b]:bounds[b + 1]].tofile(f)

    def duplicates(self) -> np.ndarray:
        """Sorted positions of every pair whose hash appeared at a smaller position."""
        self._spill()
        found = []
        for path in sorted(self.dir.glob("*.bin")):
            entries = np.fromfile(path, dtype=ENTRY)
            entries.sort(order=["hash", "pos"])
            repeat = entries["hash"][1:] == entries["hash"][:-1]
            found.append(entries["pos"][1:][repeat])
        return np.sort(np.concatenate(found)) if found else np.empty(0, dtype=np.uint64)

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def keep_mask(duplicates: np.ndarray, start: int, num_rows: int) -> np.ndarray:
    """For the rows at positions ``start .. start + num_rows - 1``: False where a duplicate."""
    lo, hi = np.searchsorted(duplicates, np.array([start, start + num_rows], dtype=np.uint64))
    keep = np.ones(num_rows, dtype=bool)
    keep[(duplicates[lo:hi] - np.uint64(start)).astype(np.int64)] = False
    return keep
