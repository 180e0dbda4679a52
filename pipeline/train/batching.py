"""Token-bucketed batching for training and validation: pure numpy, no Ray, no torch.

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
`max(src_len, tgt_len) + 1` padded positions and brings `tgt_len + 1` target tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipeline.packing import pack_by_length
from pipeline.train.shapes import ShapeBuckets


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
    # (the same permutation, ~1.5x faster at 36M rows: the length pass is a radix sort).
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
                         f"train.max_tokens_per_batch = {max_tokens_per_batch}")
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
    """Validation batches: rows by padded length, packed under the cap by
    ``pipeline.packing.pack_by_length`` (as decoding's batches are); no shuffling.

    A pair longer than the cap gets a batch of its own (validation never drops a pair).
    """
    plen = padded_len(src_len[rows], tgt_len[rows])
    return [rows[np.asarray(b)] for b in pack_by_length(plen.tolist(), max_tokens_per_batch)]


@dataclass(frozen=True)
class Batch:
    """Padded model inputs of one micro-batch (numpy int64)."""

    src: np.ndarray  # (B, S) pieces + [eos], padded
    tgt_in: np.ndarray  # (B, T) [bos] + pieces, padded
    tgt_out: np.ndarray  # (B, T) pieces + [eos], padded
    num_src_tokens: int  # non-pad source positions
    num_tgt_tokens: int  # non-pad target positions (the loss's denominator counts these)
    # Computed here on the host so the device never has to find them (a sync per lookup):
    # Flat non-pad positions, row-major, then (collate's `row_multiple`) a few pad positions:
    src_index: np.ndarray | None = None  # (>= num_src_tokens,) of src
    tgt_index: np.ndarray | None = None  # (>= num_tgt_tokens,) of tgt_in and tgt_out (same layout)
    target: np.ndarray | None = None  # tgt_out at tgt_index (pad at the added positions)


def _gather(values: np.ndarray, offsets: np.ndarray, rows: np.ndarray
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The pieces of `rows` of a flattened list column, all at once: (lens, pieces in row order,
    the row of each piece, its column within its row)."""
    starts = offsets[rows]
    lens = offsets[rows + 1] - starts
    row_idx = np.repeat(np.arange(len(rows)), lens)
    within = np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens)
    return lens, values[np.repeat(starts, lens) + within], row_idx, within


def collate(rows: np.ndarray, src_values: np.ndarray, src_offsets: np.ndarray, tgt_values: np.ndarray,
            tgt_offsets: np.ndarray, pad_id: int, bos_id: int, eos_id: int, row_multiple: int = 1,
            max_width: int = 0, buckets: ShapeBuckets | None = None) -> Batch:
    """Padded source, decoder input and target for `rows` of flattened id lists.

    `row_multiple` > 1 rounds the number of positions the model computes (`src_index`,
    `tgt_index`) up to a multiple of it by adding pad positions (widening the batch if it has too
    few, but never past `max_width` columns (the model's positions; 0 = no limit): where that
    leaves too few pads the count stays unrounded). Their target is pad, so the loss ignores them,
    and no real position attends to them (pad keys are masked in the source; in the target they
    sit after every real query). Why: oneDNN
    builds a bf16 GEMM kernel per shape, and without rounding every micro-batch of a CPU bf16 run
    has new shapes (docs/benchmarks.md, "bf16 on CPU").

    `buckets` (GPUs: `train.shape_buckets`) pads the batch to its bucketed shape instead
    (`pipeline.train.shapes`; `row_multiple` is then unused): more rows, each a source of [eos]
    and a decoder input of [bos] with a pad target, more columns, and more computed positions
    (pad positions, as above)."""
    B, every = len(rows), np.arange(len(rows))
    s_lens, s_pieces, s_row, s_col = _gather(src_values, src_offsets, rows)
    t_lens, t_pieces, t_row, t_col = _gather(tgt_values, tgt_offsets, rows)
    if buckets is None:  # B rows; positions rounded up to row_multiple (count 0)
        Bb, Ms, Mt = B, 0, 0
        S, T = _width(s_lens + 1, row_multiple, max_width), _width(t_lens + 1, row_multiple, max_width)
    else:
        Bb, S, T, Ms, Mt = buckets.shape(B, int(s_lens.max(initial=0)) + 1, int(t_lens.max(initial=0)) + 1,
                                         int(s_lens.sum()) + B, int(t_lens.sum()) + B, max_width)
    src = np.full((Bb, S), pad_id, dtype=np.int64)  # pieces + [eos]; added rows: [eos] (a key to attend to)
    src[s_row, s_col] = s_pieces
    src[every, s_lens] = eos_id
    src[B:, 0] = eos_id
    tgt_in = np.full((Bb, T), pad_id, dtype=np.int64)  # [bos] + pieces; added rows: [bos]
    tgt_in[:, 0] = bos_id
    tgt_in[t_row, t_col + 1] = t_pieces
    tgt_out = np.full((Bb, T), pad_id, dtype=np.int64)  # pieces + [eos]; added rows: pad only
    tgt_out[t_row, t_col] = t_pieces
    tgt_out[every, t_lens] = eos_id
    src_index = _prefix_positions(np.pad(s_lens + 1, (0, Bb - B)), S, row_multiple, Ms)
    tgt_index = _prefix_positions(np.pad(t_lens + 1, (0, Bb - B)), T, row_multiple, Mt)
    target = tgt_out.reshape(-1)[tgt_index]
    return Batch(src, tgt_in, tgt_out, int(s_lens.sum()) + B, int(t_lens.sum()) + B, src_index, tgt_index, target)


def _width(lens: np.ndarray, row_multiple: int, max_width: int = 0) -> int:
    """The padded width of rows of `lens`: the longest, widened (by whole columns, up to
    `max_width` if > 0) until the batch has enough pad positions to round its real positions up
    to `row_multiple`."""
    longest, total = int(lens.max(initial=1)), int(lens.sum())
    if not len(lens):
        return longest
    wanted = -(-(total + -total % row_multiple) // len(lens))  # ceil((total + need) / B)
    return max(longest, min(wanted, max_width) if max_width > 0 else wanted)


def _prefix_positions(lens: np.ndarray, width: int, row_multiple: int = 1, count: int = 0) -> np.ndarray:
    """Flat positions r * width + c, c < lens[r], of rows whose first lens[r] columns are real,
    then as many of the first pad positions (row-major) as round the count up to `row_multiple`
    (or, with `count` > 0, make it `count`)."""
    starts = np.arange(len(lens), dtype=np.int64) * width
    total = int(lens.sum())
    within = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(lens) - lens, lens)
    real = np.repeat(starts, lens) + within
    need = count - total if count > 0 else -total % row_multiple
    if not need:
        return real
    free = np.ones(len(lens) * width, dtype=bool)
    free[real] = False
    return np.concatenate([real, np.flatnonzero(free)[:need]])
