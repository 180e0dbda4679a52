"""A step's host-side batches: this worker's share of the step, collated, pinned, built ahead,
and copied to the device.

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
from typing import Callable

import numpy as np
import torch

from model import ModelConfig
from pipeline.batch_plan import step_groups
from pipeline.batch_plan.shapes import ShapeBuckets
from pipeline.train import token_batches
from pipeline.train.corpus import Corpus


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


def pin(batch: token_batches.Batch, device: torch.device, weight: float = 1.0) -> MicroBatch:
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


def to_device(batch: token_batches.Batch, device: torch.device, weight: float = 1.0) -> MicroBatch:
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
    each; `row_multiple`, `buckets`: see `token_batches.BatchLayout` (`device.row_multiple`,
    `speed.shape_buckets`). `shapes` collects the shapes handed out (the loop logs their count)."""

    def __init__(self, data: Corpus, mcfg: ModelConfig, rank: int, world: int, max_tokens: int,
                 device: torch.device, row_multiple: int = 1, buckets: ShapeBuckets | None = None):
        self.data, self.mcfg, self.rank, self.world = data, mcfg, rank, world
        self.max_tokens, self.device = max_tokens, device
        self.layout = token_batches.BatchLayout.of(mcfg, row_multiple, buckets)
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
            b = token_batches.collate(rows, d, self.layout)
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
