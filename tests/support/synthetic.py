"""Synthetic encoded shards (the `encode` stage's schema) for train tests and benchmarks.

The task is "reverse the source" over Zipf-distributed pieces: a tiny model's loss falls within a
few dozen steps (the unigram distribution first, then the copying), and the shards need no
upstream stage.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

FIRST_PIECE_ID = 4  # 0..3 are pad, unk, bos, eos


def write_reverse_task(out_dir: str | Path, num_rows: int, vocab_size: int, min_len: int = 3, max_len: int = 20,
                       num_shards: int = 2, seed: int = 0, id_offset: int = 0, length_jitter: int = 0) -> Path:
    """Write `num_rows` pairs (tgt = reversed src) as `num_shards` Parquet shards; return the folder.

    `id_offset` shifts every id (tests use it to produce ids >= vocab_size). `length_jitter` = j > 0
    makes target lengths differ from source lengths as in real text: each target loses or gains
    (repeating its first pieces) up to j pieces (at least one piece is kept).
    """
    rng = np.random.default_rng(seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lens = rng.integers(min_len, max_len + 1, size=num_rows)
    ranks = np.arange(1, vocab_size - FIRST_PIECE_ID + 1)
    probs = (1.0 / ranks) / (1.0 / ranks).sum()  # Zipf: piece k has probability ~ 1/k
    src = [(rng.choice(len(ranks), size=n, p=probs) + FIRST_PIECE_ID + id_offset).astype(np.int32) for n in lens]
    tgt = [s[::-1].copy() for s in src]
    if length_jitter:
        shifts = rng.integers(-length_jitter, length_jitter + 1, size=num_rows)
        tgt = [t[:max(1, len(t) + k)] if k <= 0 else np.concatenate([t, np.resize(t, k)]) for t, k in zip(tgt, shifts)]
    tgt_lens = np.array([len(t) for t in tgt])
    bounds = np.linspace(0, num_rows, num_shards + 1).astype(int)
    for k in range(num_shards):
        lo, hi = bounds[k], bounds[k + 1]
        table = pa.table({
            "idx": pa.array(np.arange(lo, hi, dtype=np.int64)),
            "src_ids": pa.array([s.tolist() for s in src[lo:hi]], pa.list_(pa.int32())),
            "tgt_ids": pa.array([t.tolist() for t in tgt[lo:hi]], pa.list_(pa.int32())),
            "src_len": pa.array(lens[lo:hi].astype(np.int32)),
            "tgt_len": pa.array(tgt_lens[lo:hi].astype(np.int32)),
        })
        pq.write_table(table, out / f"part-{k:05d}.parquet")
    return out
