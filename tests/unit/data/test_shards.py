"""Deterministic shards, the encoder's id lists, and a vocab that ignores the thread count."""

from __future__ import annotations

import hashlib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.data.shards import ShardWriter, shard_uris
from pipeline.data.encode import ids_array

SCHEMA = pa.schema([("idx", pa.int64()), ("text", pa.string())])


def _rows(start: int, stop: int) -> pa.Table:
    return pa.table({"idx": np.arange(start, stop, dtype=np.int64), "text": [f"r{i}" for i in range(start, stop)]},
                    schema=SCHEMA)


def _write(out, cuts: list[int]) -> list[str]:
    w = ShardWriter(str(out), 3, SCHEMA, rows_per_group=7)
    for a, b in zip(cuts, cuts[1:]):
        w.write(_rows(a, b))
    return w.close()


def test_shards_are_round_robin_and_independent_of_batching(tmp_path):
    a = _write(tmp_path / "a", [0, 50, 51, 100])
    b = _write(tmp_path / "b", [0, 3, 4, 90, 100])
    assert [p.rsplit("/", 1)[1] for p in a] == [f"part-0000{s}-of-00003.parquet" for s in range(3)]
    assert shard_uris(str(tmp_path / "a")) == a
    for pa_, pb in zip(a, b):
        assert hashlib.sha256(open(pa_, "rb").read()).digest() == hashlib.sha256(open(pb, "rb").read()).digest()
    idx = [pq.read_table(p).column("idx").to_pylist() for p in a]
    assert idx[1] == list(range(1, 100, 3))
    assert pq.ParquetFile(a[0]).metadata.num_row_groups == 5  # 34 rows in groups of 7


def test_empty_shards_still_exist(tmp_path):
    paths = _write(tmp_path, [0, 1])
    assert [pq.read_table(p).num_rows for p in paths] == [1, 0, 0]


def test_ids_array():
    arr, lengths = ids_array([[5, 6, 7], [], [9]])
    assert arr.type == pa.list_(pa.int32())
    assert arr.to_pylist() == [[5, 6, 7], [], [9]]
    assert lengths.tolist() == [3, 0, 1] and lengths.dtype == np.int32


@pytest.mark.parametrize("model_type", ["bpe"])
def test_vocab_does_not_depend_on_num_threads(wmt14_dir, tmp_path, model_type):
    from pipeline.data.vocab import train_spm

    sample = tmp_path / "sample.txt"
    lines = (wmt14_dir / "newstest2013.en").read_text().splitlines()[:1500]
    lines += (wmt14_dir / "newstest2013.de").read_text().splitlines()[:1500]
    sample.write_text("\n".join(lines) + "\n")
    digests = []
    for threads in (1, 2):
        prefix = tmp_path / f"spm{threads}"
        train_spm(sample, prefix, 500, model_type, 1.0, threads)
        digests.append(hashlib.sha256(prefix.with_suffix(".model").read_bytes()).hexdigest())
    assert digests[0] == digests[1]


def test_sample_indices_are_deterministic():
    from pipeline.data.vocab import sample_indices

    a = sample_indices(1000, 100, seed=3)
    assert (a == sample_indices(1000, 100, seed=3)).all() and len(set(a.tolist())) == 100
    assert (np.diff(a) > 0).all()
    assert not (a == sample_indices(1000, 100, seed=4)).all()
    assert sample_indices(10, 100, seed=3).tolist() == list(range(10))
