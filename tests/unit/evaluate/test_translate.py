"""The translate stage's pure core: batching, bad input, reading a split in order (no Ray)."""

from __future__ import annotations

import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from model import max_source_len
from pipeline.decoding import batching, translator
from pipeline.evaluate import translate


def test_max_source_len_leaves_room_for_the_output_budget():
    # source S + (S + 50) outputs + bos must fit 1024 positions: S <= 973.
    assert max_source_len(1024, 1.0, 50) == 973
    assert max_source_len(64, 1.0, 5) == 58
    assert max_source_len(64, 0.0, 5) == 64  # output budget independent of the source
    assert max_source_len(8, 1.0, 50) == 1  # degenerate configs still give a usable bound


def test_prepare_sources_counts_empty_and_truncated():
    sources, truncated = batching.prepare_sources([[5, 6], [], [7] * 10, [8] * 4], max_len=5, eos_id=3)
    assert sources == [[5, 6, 3], None, [7, 7, 7, 7, 3], [8, 8, 8, 8, 3]]
    assert truncated == [False, False, True, False]


def test_plan_batches_covers_everything_once_and_respects_the_token_budget():
    rng = random.Random(0)
    lengths = [rng.randint(1, 60) for _ in range(500)]
    batches = batching.plan_batches(lengths, batch_tokens=200)
    flat = [i for b in batches for i in b]
    assert sorted(flat) == list(range(len(lengths)))
    for b in batches:
        assert len(b) == 1 or len(b) * max(lengths[i] for i in b) <= 200
    # sorted by length: longest batches first, each batch a contiguous length range
    maxima = [max(lengths[i] for i in b) for b in batches]
    minima = [min(lengths[i] for i in b) for b in batches]
    assert maxima == sorted(maxima, reverse=True)
    assert all(lo >= hi for lo, hi in zip(minima, maxima[1:]))
    # padding waste is small when lengths are sorted
    padded = sum(len(b) * max(lengths[i] for i in b) for b in batches)
    assert padded <= 1.1 * sum(lengths)


def test_plan_batches_gives_an_overlong_sentence_its_own_batch():
    assert batching.plan_batches([3, 500, 4], batch_tokens=100) == [[1], [0, 2]]


def test_read_split_restores_idx_order_across_shards(tmp_path):
    d = tmp_path / "test"
    d.mkdir()
    rows = list(range(10))
    for shard, part in enumerate([rows[5:], rows[:5]]):  # shards out of order, rows reversed
        part = part[::-1]
        pq.write_table(pa.table({"idx": pa.array(part, pa.int64()),
                                 "src_ids": pa.array([[i + 4] * (i + 1) for i in part], pa.list_(pa.int32())),
                                 "tgt": [f"t{i}" for i in part]}), d / f"part-{shard}.parquet")
    df = batching.read_split(str(d), ["idx", "src_ids", "tgt"])
    assert df["idx"].tolist() == rows
    assert df["tgt"].tolist() == [f"t{i}" for i in rows]
    assert [list(x) for x in df["src_ids"]][2] == [6, 6, 6]


def test_plan_split_counts_and_keys(tmp_path):
    import pandas as pd

    df = pd.DataFrame({"idx": [0, 1, 2, 3], "src_ids": [[5], [], [6] * 30, [7, 8]]})
    rows, counts = batching.plan_split("test", df, max_len=10, eos_id=3, batch_tokens=20, first_batch_id=7)
    assert counts == {"num_sentences": 4, "num_empty": 1, "num_truncated": 1, "num_batches": 2}
    assert sorted(rows["idx"]) == [0, 2, 3]
    assert set(rows["batch_id"]) == {7, 8}
    assert list(rows.loc[rows["idx"] == 2, "src_ids"].iat[0]) == [6] * 9 + [3]


def test_write_hyps_keeps_order_and_empty_lines(tmp_path):
    import pandas as pd

    results = pd.DataFrame({"idx": [3, 0], "hyp": ["drei", "null"]})
    lines = translate.write_hyps(str(tmp_path / "h.txt"), [0, 1, 2, 3], results)
    assert lines == ["null", "", "", "drei"]
    assert (tmp_path / "h.txt").read_text() == "null\n\n\ndrei\n"


@pytest.mark.parametrize("n", [1, 3])
def test_pad_batch(n):
    t = batching.pad_batch([[5, 3], [6, 7, 8, 3], [3]][:n], pad_id=0)
    assert t.shape == (n, 2 if n == 1 else 4)
    assert t[0].tolist()[:2] == [5, 3]


def test_a_failing_batch_is_retried_sentence_by_sentence():
    tr = object.__new__(translator.Translator)  # no model needed: translate_ids is stubbed

    def translate_ids(sources, settings=None):
        if len(sources) > 1 or sources[0][0] == 13:
            raise RuntimeError("out of memory")
        return [f"s{sources[0][0]}"]

    tr.translate_ids = translate_ids
    hyps, failed = tr.translate_safely([[11, 3], [13, 3], [12, 3]])
    assert hyps == ["s11", "", "s12"] and failed == [False, True, False]


def test_translate_rows_with_nothing_to_decode_needs_no_ray():
    import pandas as pd

    rows = pd.DataFrame(columns=["split", "idx", "batch_id", "src_ids"])
    out = translate.translate_rows(rows, {}, num_workers=2, resources={})
    assert out.empty and {"idx", "hyp", "failed"} <= set(out.columns)


def test_cpu_actors_start_with_the_threads_they_decode_with(monkeypatch):
    """The actors hold run.data_num_cpus Ray CPUs but decode with the node's threads: they are started
    with OMP_NUM_THREADS at that count, so none calls torch.set_num_threads (`pipeline.cpu_threads`)."""
    from unittest import mock

    from pipeline.config import load_config

    cfg = load_config("configs/local.toml", ["--decode.use_gpu=false", "--decode.num_workers=1"])
    with mock.patch("ray.cluster_resources", return_value={"CPU": 4.0}), \
            mock.patch("pipeline.ray_env.node_cpus", return_value=[4.0]):
        resources, device, threads = translate._actor_resources(cfg)
    assert device == "cpu" and threads == 4
    assert resources["num_cpus"] == cfg.run.data_num_cpus
    assert resources["runtime_env"] == {"env_vars": {"OMP_NUM_THREADS": "4"}}
