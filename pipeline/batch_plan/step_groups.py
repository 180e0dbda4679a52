"""The global batch plan: which pairs train, each step's group of pairs and its split over the
workers. Pure numpy, no Ray, no torch; every worker computes the same plan, and `--plan`'s bill
prices it (`pipeline.plan.bill`).

§5.1: "Sentence pairs were batched together by approximate sequence length. Each training batch
contained a set of sentence pairs containing approximately 25000 source tokens and 25000 target
tokens." We take that literally, in two levels:

1. **Step groups** (`plan_epoch`): every epoch, the kept pairs are ordered by padded length (ties
   broken by a seeded random key) and cut into consecutive groups of ~`tokens_per_step` target
   tokens; the group order is then shuffled with the same seed. One group = one optimizer step.
   The plan depends on the data, `tokens_per_step`, the seed and the epoch only: NOT on the
   number of workers nor on the per-worker memory cap, so 1 GPU and 8 GPUs take the same steps
   over the same sentences (and follow the same lr curve).
2. **Micro-batches** (`split_step`): a group is split into `num_workers * accum` contiguous
   chunks of balanced padded size, each under `max_tokens_per_batch`; chunk j goes to worker
   j % num_workers as its micro-batch j // num_workers. `accum` (gradient accumulation) is the
   smallest value for which every chunk fits, so it follows from the workers and the cap.

Lengths here are the pieces in the shards; the model adds one special token per side (source +
[eos], decoder input [bos] + pieces, target pieces + [eos]), so a pair costs
`max(src_len, tgt_len) + 1` padded positions and brings `tgt_len + 1` target tokens. The padded
arrays of a micro-batch are `pipeline.train.feeder.collate`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipeline.config import Config
from pipeline.packing import pack_by_length


def worker_range(cfg: Config) -> tuple[int, int]:
    """(min, max) workers of `workers.num_workers`: (N, N) for a fixed count, else the elastic range
    (`pipeline.train.elastic`). The bill counts the most workers."""
    n = cfg.workers.num_workers
    return (int(n[0]), int(n[1])) if isinstance(n, list) else (int(n), int(n))


def keep_mask(src_len: np.ndarray, tgt_len: np.ndarray, max_len: int) -> np.ndarray:
    """Pairs to train on: no side longer than `max_len` pieces and no empty side."""
    return (src_len <= max_len) & (tgt_len <= max_len) & (src_len > 0) & (tgt_len > 0)


def padded_len(src_len: np.ndarray, tgt_len: np.ndarray) -> np.ndarray:
    """Positions a pair occupies in a padded batch: max(src, tgt) pieces + 1 special token."""
    return np.maximum(src_len, tgt_len).astype(np.int64) + 1


def target_tokens(tgt_len: np.ndarray) -> np.ndarray:
    """Target tokens of each pair (pieces + eos): what the loss is averaged over."""
    return tgt_len.astype(np.int64) + 1


def _rng(seed: int, *keys: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([seed, *keys]))


def plan_epoch(rows: np.ndarray, src_len: np.ndarray, tgt_len: np.ndarray, tokens_per_step: int,
               seed: int, epoch: int) -> list[np.ndarray]:
    """The optimizer steps of one epoch: a list of row-index arrays, each sorted by length.

    `rows` are the kept rows; `src_len`/`tgt_len` are indexed by row. A group closes as soon as
    it holds >= `tokens_per_step` target tokens; a last group with fewer than half of that is
    left out of this epoch (it would be a noisy small step; other rows end up last next epoch).
    """
    rng = _rng(seed, epoch, 0)
    plen = padded_len(src_len[rows], tgt_len[rows])
    # By length, random among equal lengths: np.lexsort((random, plen)), as two stable sorts
    # (the same permutation, faster at tens of millions of rows: the length pass is a radix sort).
    by_random = np.argsort(rng.random(len(rows)), kind="stable")
    key = plen[by_random].astype(np.int16 if plen.max(initial=0) < 2**15 else np.int64)
    order = by_random[np.argsort(key, kind="stable")]
    sorted_rows = rows[order]
    cum = np.cumsum(target_tokens(tgt_len[sorted_rows]))
    groups: list[np.ndarray] = []
    start = 0
    while start < len(sorted_rows):
        base = cum[start - 1] if start else 0
        # First index whose running total reaches tokens_per_step: the group ends there.
        end = int(np.searchsorted(cum, base + tokens_per_step, side="left")) + 1
        end = min(end, len(sorted_rows))
        if cum[end - 1] - base < tokens_per_step / 2 and groups:
            break
        groups.append(sorted_rows[start:end])
        start = end
    perm = _rng(seed, epoch, 1).permutation(len(groups))
    return [groups[i] for i in perm]


@dataclass(frozen=True)
class StepSplit:
    """One optimizer step cut into micro-batches: `chunks[w][m]` = rows of worker w, micro m."""

    accum: int  # micro-batches per worker (gradient accumulation steps)
    chunks: list[list[np.ndarray]]  # [num_workers][accum], possibly empty arrays

    def for_worker(self, rank: int) -> list[np.ndarray]:
        return self.chunks[rank]


def _greedy_cuts(plen_sorted: np.ndarray, bound: int) -> list[int]:
    """Cut lengths sorted ascending into the fewest contiguous chunks of padded size <= bound.

    Greedy is optimal here: a chunk [i, j] costs (j - i + 1) * plen[j], increasing in j.
    """
    n, cuts, i = len(plen_sorted), [0], 0
    while i < n:
        cost = np.arange(1, n - i + 1) * plen_sorted[i:]  # cost of [i, i], [i, i+1], ...
        i += max(1, int(np.searchsorted(cost, bound, side="right")))
        cuts.append(i)
    return cuts


def split_step(group: np.ndarray, src_len: np.ndarray, tgt_len: np.ndarray, num_workers: int,
               max_tokens_per_batch: int) -> StepSplit:
    """Cut one step group into `num_workers * accum` chunks under `max_tokens_per_batch`.

    `accum` = ceil(fewest chunks that fit the cap / num_workers). The chunks are contiguous in
    length order and balanced: the per-chunk bound is lowered (binary search) to the smallest one
    that still needs no more than `num_workers * accum` chunks, so workers get similar work.
    Chunks are empty when there are fewer chunks than slots (e.g. fewer pairs than workers).
    """
    plen = padded_len(src_len[group], tgt_len[group])
    order = np.argsort(plen, kind="stable")
    group, plen = group[order], plen[order]
    longest = int(plen.max(initial=0))
    if longest > max_tokens_per_batch:
        raise ValueError(f"a pair of {longest} padded tokens does not fit "
                         f"speed.max_tokens_per_batch = {max_tokens_per_batch}")
    needed = len(_greedy_cuts(plen, max_tokens_per_batch)) - 1
    accum = max(1, -(-needed // num_workers))
    slots = num_workers * accum
    lo, hi = max(longest, 1), max_tokens_per_batch  # the smallest bound needing <= slots chunks
    while lo < hi:
        mid = (lo + hi) // 2
        if len(_greedy_cuts(plen, mid)) - 1 <= slots:
            hi = mid
        else:
            lo = mid + 1
    cuts = _greedy_cuts(plen, lo)
    cuts += [cuts[-1]] * (slots + 1 - len(cuts))  # empty chunks at the end
    chunks = [[group[cuts[m * num_workers + w]:cuts[m * num_workers + w + 1]] for m in range(accum)]
              for w in range(num_workers)]
    return StepSplit(accum=accum, chunks=chunks)


def plan_eval_batches(rows: np.ndarray, src_len: np.ndarray, tgt_len: np.ndarray,
                      max_tokens_per_batch: int) -> list[np.ndarray]:
    """Validation batches: rows by length, greedily packed under the cap; no shuffling.

    A pair longer than the cap gets a batch of its own (validation never drops a pair).
    """
    plen = padded_len(src_len[rows], tgt_len[rows])
    return [rows[np.asarray(b)] for b in pack_by_length(plen.tolist(), max_tokens_per_batch)]
