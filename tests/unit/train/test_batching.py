"""Token-bucketed batching (pipeline/batch_plan/step_groups.py): pure numpy, checked against brute-force facts."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.batch_plan import step_groups

from pipeline.train import feeder
from pipeline.train.corpus import Corpus
from pipeline.train.feeder import BatchLayout


def _lengths(n: int = 500, seed: int = 0, hi: int = 40) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    src = rng.integers(1, hi, size=n)
    tgt = np.clip(src + rng.integers(-3, 4, size=n), 1, None)
    return src, tgt


def test_keep_mask_drops_long_and_empty_pairs():
    src = np.array([3, 10, 11, 0, 5])
    tgt = np.array([3, 10, 2, 4, 12])
    assert step_groups.keep_mask(src, tgt, max_len=10).tolist() == [True, True, False, False, False]


def test_plan_epoch_groups_reach_tokens_per_step_and_cover_the_rows():
    src, tgt = _lengths()
    rows = np.arange(len(src))
    plan = step_groups.plan_epoch(rows, src, tgt, tokens_per_step=600, seed=1, epoch=0)
    used = np.concatenate(plan)
    assert len(np.unique(used)) == len(used)  # no row twice in an epoch
    per_step = [int(step_groups.target_tokens(tgt[g]).sum()) for g in plan]
    # Each group closes as soon as it holds >= 600 target tokens (so < 600 + one pair); at most
    # one group (the epoch's remainder, >= half a step) is smaller.
    assert all(t < 600 + 41 for t in per_step)
    assert sum(t < 600 for t in per_step) <= 1 and min(per_step) >= 300
    left_out = set(rows) - set(used.tolist())
    assert int(step_groups.target_tokens(tgt[list(left_out)]).sum()) < 300 if left_out else True


def test_plan_epoch_buckets_by_length():
    src, tgt = _lengths(n=2000)
    plan = step_groups.plan_epoch(np.arange(len(src)), src, tgt, tokens_per_step=800, seed=1, epoch=0)
    plen = step_groups.padded_len(src, tgt)
    spread = [int(plen[g].max() - plen[g].min()) for g in plan]
    assert np.median(spread) <= 2  # a step holds pairs of (nearly) one length


def test_plan_epoch_is_seeded_and_reshuffled_per_epoch():
    src, tgt = _lengths()
    rows = np.arange(len(src))
    a = step_groups.plan_epoch(rows, src, tgt, 600, seed=1, epoch=0)
    b = step_groups.plan_epoch(rows, src, tgt, 600, seed=1, epoch=0)
    c = step_groups.plan_epoch(rows, src, tgt, 600, seed=1, epoch=1)
    assert all(np.array_equal(x, y) for x, y in zip(a, b)) and len(a) == len(b)
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))


def test_plan_epoch_only_uses_the_given_rows():
    src, tgt = _lengths()
    rows = np.arange(0, len(src), 2)
    used = np.concatenate(step_groups.plan_epoch(rows, src, tgt, 500, seed=3, epoch=0))
    assert set(used.tolist()) <= set(rows.tolist())


@pytest.mark.parametrize("num_workers", [1, 2, 3, 8])
def test_split_step_chunks_fit_the_cap_and_partition_the_group(num_workers):
    src, tgt = _lengths(n=300)
    group = np.arange(300)
    cap = 400
    split = step_groups.split_step(group, src, tgt, num_workers, cap)
    assert len(split.chunks) == num_workers and all(len(c) == split.accum for c in split.chunks)
    plen = step_groups.padded_len(src, tgt)
    for worker in split.chunks:
        for rows in worker:
            assert len(rows) == 0 or len(rows) * plen[rows].max() <= cap
    together = np.concatenate([rows for worker in split.chunks for rows in worker])
    assert sorted(together.tolist()) == group.tolist()
    # Never more micro-batches than needed: the fewest chunks under the cap, found by brute force
    # over every contiguous cut of the sorted lengths (dynamic programming), need accum slots.
    s = np.sort(plen[group])
    fewest = [0] + [10**9] * len(s)
    for j in range(1, len(s) + 1):
        fewest[j] = min(fewest[i] + 1 for i in range(j) if (j - i) * s[j - 1] <= cap)
    assert split.accum == -(-fewest[-1] // num_workers)


def test_split_step_does_not_change_the_step_with_the_number_of_workers():
    src, tgt = _lengths(n=120)
    group = np.arange(40, 120)
    rows_1 = np.concatenate(step_groups.split_step(group, src, tgt, 1, 300).chunks[0])
    split_4 = step_groups.split_step(group, src, tgt, 4, 300)
    rows_4 = np.concatenate([r for w in split_4.chunks for r in w])
    assert sorted(rows_1.tolist()) == sorted(rows_4.tolist()) == group.tolist()


def test_split_step_gives_empty_chunks_when_workers_outnumber_pairs():
    src, tgt = np.array([5, 5]), np.array([5, 5])
    split = step_groups.split_step(np.array([0, 1]), src, tgt, num_workers=4, max_tokens_per_batch=100)
    assert split.accum == 1
    assert sorted(len(c[0]) for c in split.chunks) == [0, 0, 1, 1]


def test_split_step_rejects_a_pair_longer_than_the_cap():
    with pytest.raises(ValueError, match="max_tokens_per_batch"):
        step_groups.split_step(np.array([0]), np.array([50]), np.array([10]), 1, 20)


def test_plan_eval_batches_cover_every_row_once_under_the_cap():
    src, tgt = _lengths(n=200)
    rows = np.arange(200)
    batches = step_groups.plan_eval_batches(rows, src, tgt, 256)
    plen = step_groups.padded_len(src, tgt)
    assert sorted(np.concatenate(batches).tolist()) == rows.tolist()
    assert all(len(b) * plen[b].max() <= 256 for b in batches)


def test_collate_adds_specials_and_pads():
    # rows: 0 -> src [10, 11], tgt [20]; 1 -> src [12], tgt [21, 22, 23]
    src_values, src_offsets = np.array([10, 11, 12], np.int32), np.array([0, 2, 3])
    tgt_values, tgt_offsets = np.array([20, 21, 22, 23], np.int32), np.array([0, 1, 4])
    b = feeder.collate(np.array([1, 0]),
                              Corpus(src_values=src_values, src_offsets=src_offsets, tgt_values=tgt_values,
                                     tgt_offsets=tgt_offsets),
                              BatchLayout(pad_id=0, bos_id=2, eos_id=3))
    assert b.src.tolist() == [[12, 3, 0], [10, 11, 3]]
    assert b.tgt_in.tolist() == [[2, 21, 22, 23], [2, 20, 0, 0]]
    assert b.tgt_out.tolist() == [[21, 22, 23, 3], [20, 3, 0, 0]]
    assert (b.num_src_tokens, b.num_tgt_tokens) == (5, 6)
    assert b.src.dtype == np.int64


def _ragged(rng: np.random.Generator, n: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
    lens = rng.integers(0, hi, size=n)
    return rng.integers(4, 50, size=int(lens.sum())).astype(np.int32), np.concatenate([[0], np.cumsum(lens)])


@pytest.mark.parametrize("multiple", [8, 64])
def test_collate_rounds_the_computed_positions_up_with_pad_positions(multiple):
    rng = np.random.default_rng(multiple)
    for _ in range(300):
        n = int(rng.integers(1, 7))
        (sv, so), (tv, to) = _ragged(rng, n, 9), _ragged(rng, n, 9)
        rows = rng.permutation(n)
        plain = feeder.collate(rows, Corpus(src_values=sv, src_offsets=so, tgt_values=tv, tgt_offsets=to),
                                      BatchLayout(pad_id=0, bos_id=2, eos_id=3))
        b = feeder.collate(rows, Corpus(src_values=sv, src_offsets=so, tgt_values=tv, tgt_offsets=to),
                                  BatchLayout(pad_id=0, bos_id=2, eos_id=3, row_multiple=multiple))
        for index, ids, real in ((b.src_index, b.src, plain.num_src_tokens), (b.tgt_index, b.tgt_in, plain.num_tgt_tokens)):
            assert len(index) % multiple == 0 and len(index) - real < multiple
            assert len(np.unique(index)) == len(index)
            flat = ids.reshape(-1)[index]
            assert (flat[:real] != 0).all() and (flat[real:] == 0).all()  # the real positions, then pads
        # The same sentences, padded further to the right (whole columns) only when it had too few pads.
        for wide, narrow in ((b.src, plain.src), (b.tgt_in, plain.tgt_in), (b.tgt_out, plain.tgt_out)):
            assert (wide[:, :narrow.shape[1]] == narrow).all() and (wide[:, narrow.shape[1]:] == 0).all()
        assert b.target[:plain.num_tgt_tokens].tolist() == plain.target.tolist()
        assert (b.target[plain.num_tgt_tokens:] == 0).all()
        assert (b.num_src_tokens, b.num_tgt_tokens) == (plain.num_src_tokens, plain.num_tgt_tokens)


def test_rounding_never_widens_past_the_models_positions():
    # One row of 6 source pieces (+ eos = 7 positions): rounding to 64 would need 57 more columns.
    values, offsets = np.arange(4, 10, dtype=np.int32), np.array([0, 6])
    ids = Corpus(src_values=values, src_offsets=offsets, tgt_values=values, tgt_offsets=offsets)
    b = feeder.collate(np.array([0]), ids,
                              BatchLayout(pad_id=0, bos_id=2, eos_id=3, row_multiple=64, max_width=16))
    assert b.src.shape == b.tgt_in.shape == (1, 16)
    assert len(b.src_index) == len(b.tgt_index) == 16  # as many as fit: 7 real + 9 pad, unrounded
    assert (b.src.reshape(-1)[b.src_index[7:]] == 0).all() and (b.target[7:] == 0).all()
    longer = feeder.collate(np.array([0]), ids,
                                   BatchLayout(pad_id=0, bos_id=2, eos_id=3, row_multiple=64, max_width=4))
    assert longer.src.shape == (1, 7) and len(longer.src_index) == 7  # never narrower than the sentence


@pytest.mark.parametrize("rows, src, tgt, cap, expected", [
    # padded lengths 4, 2, 6, 4, 3 -> by length rows 1, 4, 0, 3, 2; 3 x 4 > 8 cuts after row 4,
    # 3 x 6 > 8 after row 3
    ([0, 1, 2, 3, 4], [3, 1, 5, 1, 2], [2, 1, 4, 3, 2], 8, [[1, 4], [0, 3], [2]]),
    # row 0 (10 padded tokens) is over the cap of 5: a batch of its own, nothing dropped
    ([0, 1, 2], [9, 1, 1], [1, 1, 1], 5, [[1, 2], [0]]),
    # rows 7, 2, 5 of 8 pairs, padded 5, 5, 4: equal lengths keep their order in `rows`
    ([7, 2, 5], [0, 0, 4, 0, 0, 1, 0, 4], [0, 0, 2, 0, 0, 3, 0, 4], 10, [[5, 7], [2]]),
    ([], [1], [1], 8, []),
])
def test_plan_eval_batches_match_hand_packed_batches(rows, src, tgt, cap, expected):
    batches = step_groups.plan_eval_batches(np.array(rows, dtype=np.int64), np.array(src), np.array(tgt), cap)
    assert [b.tolist() for b in batches] == expected
