"""A step's host-side batches: this worker's share of the step, collated, pinned, built ahead,
and copied to the device.

`collate` lays one micro-batch out as padded numpy arrays: source, decoder input, target and the
real positions, computed on the host. Which rows go into a micro-batch is the global batch plan's
(`pipeline.batch_plan.step_groups`); the shapes a GPU pads to are
`pipeline.batch_plan.shapes.ShapeBuckets`. One special token per side: source pieces + [eos],
decoder input [bos] + pieces, target pieces + [eos].

`StepPlan` says which pairs training keeps and which step group comes next (the global plan,
the same on every worker: `pipeline.batch_plan.step_groups`); `HostBatcher` turns one step group (row ids
of the global plan) into this worker's `StepBatch`: its micro-batches and the step's token counts;
`Feeder` builds the next step's batches in a background thread while the current step runs. All
three are O(batch) and touch no device; `upload` is the one copy to the device (asynchronous on a
GPU, from pinned memory).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Protocol

import numpy as np
import torch

from model import ModelConfig
from pipeline.batch_plan import step_groups
from pipeline.batch_plan.shapes import ShapeBuckets
from pipeline.train.corpus import Corpus


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
    def of(cls, mc: ModelConfig, row_multiple: int = 1, buckets: ShapeBuckets | None = None) -> BatchLayout:
        """The layout of the model `mc`: its special ids, at most its positions."""
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


@dataclass(kw_only=True)
class MicroBatch:
    """One micro-batch's model inputs as torch tensors (`pin`: on the host; `upload`: on the device)."""

    src: torch.Tensor  # (B, S)
    tgt_in: torch.Tensor  # (B, T)
    tgt_out: torch.Tensor  # (B, T)
    weight: float = 1.0  # 0 for a stand-in when a worker has no rows for this micro-step
    src_index: torch.Tensor | None = None  # (Ms,) flat non-pad positions of src (host-computed)
    tgt_index: torch.Tensor | None = None  # (M,) flat non-pad positions of tgt_in / tgt_out
    target: torch.Tensor | None = None  # (M,) tgt_out at those positions


def pin(batch: Batch, device: torch.device, weight: float = 1.0) -> MicroBatch:
    """Host side of `to_device`: torch tensors over the batch's arrays, in pinned memory for a GPU
    (so the copy can be asynchronous). Safe to run in a background thread (prefetch)."""
    def t(x: np.ndarray | None) -> torch.Tensor | None:
        if x is None:
            return None
        x = torch.from_numpy(x)
        return x.pin_memory() if device.type == "cuda" else x

    return MicroBatch(src=t(batch.src), tgt_in=t(batch.tgt_in), tgt_out=t(batch.tgt_out), weight=weight,
                      src_index=t(batch.src_index), tgt_index=t(batch.tgt_index), target=t(batch.target))


def upload(mb: MicroBatch, device: torch.device) -> MicroBatch:
    """Copy a pinned micro-batch to the device without waiting for it (a no-op on CPU)."""
    if device.type != "cuda":
        return mb
    def t(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else x.to(device, non_blocking=True)

    return MicroBatch(src=t(mb.src), tgt_in=t(mb.tgt_in), tgt_out=t(mb.tgt_out), weight=mb.weight,
                      src_index=t(mb.src_index), tgt_index=t(mb.tgt_index), target=t(mb.target))


def to_device(batch: Batch, device: torch.device, weight: float = 1.0) -> MicroBatch:
    """`pin` then `upload`: a host batch on the device in one call (the dev loss, tests)."""
    return upload(pin(batch, device, weight), device)


@dataclass
class StepBatch:
    """One optimizer step's share of this worker: its micro-batches and the whole step's token
    counts (every worker's; the loss is normalized by `tgt_tokens`, `pipeline.train.step`)."""

    micro_batches: list[MicroBatch]  # on the host (pinned on a GPU); `upload` copies them
    tgt_tokens: int  # target tokens of the step, all workers (pieces + eos)
    src_tokens: int  # source tokens of the step, all workers (pieces + eos)


class StepPlan:
    """The pairs training keeps (at most `max_len` pieces a side) and each epoch's step groups
    (`step_groups.plan_epoch`: they depend on the data, `tokens_per_step`, the seed and the epoch)."""

    def __init__(self, data: Corpus, max_len: int, tokens_per_step: int, seed: int):
        self.data, self.tokens_per_step, self.seed = data, tokens_per_step, seed
        keep = step_groups.keep_mask(data.src_len, data.tgt_len, max_len)
        self.rows = np.flatnonzero(keep).astype(np.int32 if len(keep) < 2**31 else np.int64)
        self.num_dropped = int(len(keep) - len(self.rows))
        self._epoch, self._groups = -1, []

    def groups(self, epoch: int) -> list[np.ndarray]:
        """The step groups of `epoch`, in training order (the last epoch's are kept)."""
        if epoch != self._epoch:
            d = self.data
            self._groups = step_groups.plan_epoch(self.rows, d.src_len, d.tgt_len, self.tokens_per_step, self.seed,
                                                  epoch)
            self._epoch = epoch
        return self._groups

    def at(self, epoch: int, index: int) -> tuple[np.ndarray | None, np.ndarray | None]:
        """The step group `index` of `epoch` and the next one (None: past the epoch's end)."""
        groups = self.groups(epoch)
        return (groups[index] if index < len(groups) else None,
                groups[index + 1] if index + 1 < len(groups) else None)

    def accum(self, group: np.ndarray, world: int, max_tokens_per_batch: int) -> int:
        """The micro-batches per worker of `group` on `world` workers (`step_groups.split_step`)."""
        return step_groups.split_step(group, self.data.src_len, self.data.tgt_len, world, max_tokens_per_batch).accum


class HostBatcher:
    """This worker's micro-batches of one step (`rank` of `world`), under `max_tokens` padded tokens
    each; `row_multiple`, `buckets`: see `BatchLayout` (`device.row_multiple`,
    `speed.shape_buckets`). `shapes` collects the shapes handed out (the loop logs their count)."""

    def __init__(self, data: Corpus, mcfg: ModelConfig, rank: int, world: int, max_tokens: int,
                 device: torch.device, row_multiple: int = 1, buckets: ShapeBuckets | None = None):
        self.data, self.mcfg, self.rank, self.world = data, mcfg, rank, world
        self.max_tokens, self.device = max_tokens, device
        self.layout = BatchLayout.of(mcfg, row_multiple, buckets)
        self.shapes: set[tuple[int, ...]] = set()

    def __call__(self, group: np.ndarray) -> StepBatch:
        d = self.data
        step_tgt = int(step_groups.target_tokens(d.tgt_len[group]).sum())
        step_src = int(d.src_len[group].sum()) + len(group)
        split = step_groups.split_step(group, d.src_len, d.tgt_len, self.world, self.max_tokens)
        micro = []
        for rows in split.for_worker(self.rank):
            weight = 1.0 if len(rows) else 0.0  # no rows left for this worker: a zero-weight stand-in
            rows = rows if len(rows) else group[:1]
            b = collate(rows, d, self.layout)
            self.shapes.add(b.src.shape + b.tgt_in.shape + (len(b.src_index), len(b.tgt_index)))
            micro.append(pin(b, self.device, weight))
        return StepBatch(micro, tgt_tokens=step_tgt, src_tokens=step_src)


class Feeder:
    """Hands out a step's host micro-batches, built one step ahead in a background thread.

    The batches are a pure function of the step's rows, so prefetch on or off gives the same
    losses (tested); on a GPU the collate, the pinning and the index computation then overlap
    the previous step's kernels instead of delaying the next launch."""

    def __init__(self, build: Callable[[np.ndarray], StepBatch], prefetch: bool):
        self.build = build
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="prefetch") if prefetch else None
        self.pending: tuple[np.ndarray, Future] | None = None

    def take(self, group: np.ndarray) -> StepBatch:
        """The step's batches: the prefetched ones if they are this group's, else built now."""
        ahead, self.pending = self.pending, None
        if ahead is not None and ahead[0] is group:
            return ahead[1].result()
        return self.build(group)

    def ahead(self, next_group: np.ndarray | None) -> None:
        """Start building the next step's batches in the background (no-op without prefetch)."""
        if self.pool is not None and next_group is not None:
            self.pending = (next_group, self.pool.submit(self.build, next_group))

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
