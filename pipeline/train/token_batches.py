"""A micro-batch's padded arrays (`collate`): source, decoder input, target and the real
positions, computed on the host. Pure numpy, no Ray, no torch.

Which rows go into a micro-batch is the global batch plan's (`pipeline.batch_plan.step_groups`); the
shapes a GPU pads to are `pipeline.batch_plan.shapes.ShapeBuckets`. One special token per side: source
pieces + [eos], decoder input [bos] + pieces, target pieces + [eos].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from pipeline.batch_plan.shapes import ShapeBuckets


class IdLists(Protocol):
    """A split's flattened id lists (`pipeline.train.corpus.Corpus`): pair i's source is
    src_values[src_offsets[i]:src_offsets[i + 1]], its target likewise."""

    src_values: np.ndarray
    src_offsets: np.ndarray
    tgt_values: np.ndarray
    tgt_offsets: np.ndarray


@dataclass(frozen=True, kw_only=True)
class BatchLayout:
    """How `collate` lays a micro-batch out: the model's special ids and what it pads to."""

    pad_id: int
    bos_id: int
    eos_id: int
    row_multiple: int = 1  # computed positions rounded up to a multiple of it (`device.row_multiple`)
    max_width: int = 0  # never more columns than this (the model's positions); 0 = no limit
    buckets: ShapeBuckets | None = None  # pad to the bucketed shape instead (GPUs: `speed.shape_buckets`)

    @classmethod
    def of(cls, mc, row_multiple: int = 1, buckets: ShapeBuckets | None = None) -> "BatchLayout":
        """The layout of the model `mc` (a `model.ModelConfig`): its special ids, at most its positions."""
        return cls(pad_id=mc.pad_id, bos_id=mc.bos_id, eos_id=mc.eos_id, row_multiple=row_multiple,
                   max_width=mc.max_positions, buckets=buckets)


@dataclass(frozen=True, kw_only=True)
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


def collate(rows: np.ndarray, data: IdLists, layout: BatchLayout) -> Batch:
    """Padded source, decoder input and target for `rows` of the id lists `data`, laid out by `layout`.

    `layout.row_multiple` > 1 rounds the number of positions the model computes (`src_index`,
    `tgt_index`) up to a multiple of it by adding pad positions (widening the batch if it has too
    few, but never past `max_width` columns (the model's positions; 0 = no limit): where that
    leaves too few pads the count stays unrounded). Their target is pad, so the loss ignores them,
    and no real position attends to them (pad keys are masked in the source; in the target they
    sit after every real query). Why: oneDNN builds a bf16 GEMM kernel per shape, and without
    rounding every micro-batch of a CPU bf16 run has new shapes (docs/benchmarks.md, "Local mode's
    real batches: bf16 kernels per shape").

    `layout.buckets` (GPUs: `speed.shape_buckets`) pads the batch to its bucketed shape instead
    (`pipeline.batch_plan.shapes`; `row_multiple` is then unused): more rows, each a source of [eos]
    and a decoder input of [bos] with a pad target, more columns, and more computed positions
    (pad positions, as above)."""
    pad_id, bos_id, eos_id = layout.pad_id, layout.bos_id, layout.eos_id
    row_multiple, max_width, buckets = layout.row_multiple, layout.max_width, layout.buckets
    B, every = len(rows), np.arange(len(rows))
    s_lens, s_pieces, s_row, s_col = _gather(data.src_values, data.src_offsets, rows)
    t_lens, t_pieces, t_row, t_col = _gather(data.tgt_values, data.tgt_offsets, rows)
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
    return Batch(src=src, tgt_in=tgt_in, tgt_out=tgt_out, num_src_tokens=int(s_lens.sum()) + B,
                 num_tgt_tokens=int(t_lens.sum()) + B, src_index=src_index, tgt_index=tgt_index, target=target)


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
