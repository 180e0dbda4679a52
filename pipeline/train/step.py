"""One optimizer step of the paper's recipe (§5.3, §5.4): pure torch, no Ray, no data loading.

The update is the gradient of

    loss_step = (sum over the step's target tokens, all micro-batches, all workers, of the
                 label-smoothed loss) / N

whatever the split into micro-batches and workers: each worker back-propagates
`loss_sum(micro) * world_size / N` (DDP averages gradients over workers, i.e. divides by
world_size) and skips DDP's all-reduce on all but its last micro-batch (`no_sync`). N, the
step's target-token count, is known to every worker from the global batch plan
(`pipeline.plan.step_groups`), so no all-reduce of the token count is needed.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, ContextManager

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from model import label_smoothed_nll, linear_label_smoothed_nll
from pipeline.train import token_batches


def step_seed(seed: int, rank: int, step: int) -> int:
    """Dropout RNG seed of (worker, step): resuming at any step replays the same masks."""
    return int(np.random.SeedSequence([seed, rank, step]).generate_state(1, np.uint64)[0] % (2**63))


@dataclass
class MicroBatch:
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

    return MicroBatch(t(batch.src), t(batch.tgt_in), t(batch.tgt_out), weight, t(batch.src_index),
                      t(batch.tgt_index), t(batch.target))


def upload(mb: MicroBatch, device: torch.device) -> MicroBatch:
    """Copy a pinned micro-batch to the device without waiting for it (a no-op on CPU)."""
    if device.type != "cuda":
        return mb
    def t(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else x.to(device, non_blocking=True)

    return MicroBatch(t(mb.src), t(mb.tgt_in), t(mb.tgt_out), mb.weight, t(mb.src_index), t(mb.tgt_index),
                      t(mb.target))


def to_device(batch: token_batches.Batch, device: torch.device, weight: float = 1.0) -> MicroBatch:
    return upload(pin(batch, device, weight), device)


def micro_batch_loss(model: torch.nn.Module, mb: MicroBatch, epsilon: float, pad_id: int,
                     autocast: Callable[[], ContextManager] = contextlib.nullcontext,
                     fused_output: tuple[torch.Tensor, torch.dtype] | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss_sum, nll_sum) of one micro-batch at its real target positions: the model under
    `autocast`, then the label-smoothed loss of its logits, or with `fused_output` = (the output
    projection's weight, the dtype it multiplies in) the projection fused with the loss
    (`model.linear_label_smoothed_nll`: no (M, V) logits; `train.fused_loss`, on GPUs). Training
    steps and validation both compute it so."""
    # (M,): the projection skips pad positions. A boolean index would wait for the device to learn
    # M; collate gives the target and the positions, computed on the host.
    target = mb.target if mb.target is not None else mb.tgt_out[mb.tgt_out != pad_id]
    with autocast():
        out = model(mb.src, mb.tgt_in, nonpad_only=True, src_index=mb.src_index, tgt_index=mb.tgt_index,
                    hidden_only=fused_output is not None)  # (M, V), or (M, d) for the fused loss
    if fused_output is None:
        return label_smoothed_nll(out, target, epsilon=epsilon, ignore_index=pad_id)
    weight, dtype = fused_output
    return linear_label_smoothed_nll(out, weight, target, epsilon, pad_id, dtype)


def accumulate_gradients(model: torch.nn.Module, micro_batches: list[MicroBatch], step_tgt_tokens: int,
                         world_size: int, epsilon: float, pad_id: int,
                         autocast: Callable[[], ContextManager] = contextlib.nullcontext,
                         scaler: torch.amp.GradScaler | None = None,
                         fused_output: tuple[torch.Tensor, torch.dtype] | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Back-propagate this worker's share of the step; return its (loss_sum, nll_sum) (detached).

    After the last micro-batch (and DDP's all-reduce) every worker holds
    d/dθ [ sum of token losses over the whole step / step_tgt_tokens ].

    `fused_output`: see `micro_batch_loss`.
    """
    scale = world_size / step_tgt_tokens
    loss_total = torch.zeros((), device=micro_batches[0].src.device)
    nll_total = torch.zeros((), device=micro_batches[0].src.device)
    for i, mb in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        sync = contextlib.nullcontext() if last or not isinstance(model, DDP) else model.no_sync()
        with sync:
            loss, nll = micro_batch_loss(model, mb, epsilon, pad_id, autocast, fused_output)
            if mb.weight != 1.0:
                loss, nll = loss * mb.weight, nll * mb.weight
            scaled = loss * scale
            (scaler.scale(scaled) if scaler is not None else scaled).backward()
        loss_total += loss.detach()
        nll_total += nll.detach()
    return loss_total, nll_total


def optimizer_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                   scaler: torch.amp.GradScaler | None, clip_norm: float, want_norm: bool) -> float | None:
    """Clip (optional), step, advance the lr schedule, zero the grads; the grad norm if asked."""
    if scaler is not None:
        scaler.unscale_(optimizer)
    norm = None
    if clip_norm > 0 or want_norm:
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        total = torch.nn.utils.get_total_norm(grads)
        if clip_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(model.parameters(), clip_norm, total)
        norm = float(total) if want_norm else None
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return norm


def distributed(model: torch.nn.Module, device: torch.device, world: int, grad_compression: str,
                always: bool = False) -> torch.nn.Module:
    """`model` as the step calls it: itself on one worker, else wrapped in DDP (`always`: even on
    one, as benchmarks/gpu_check.py checks DDP + NCCL + the bf16 hook on one GPU)."""
    if world == 1 and not always:
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP

    ids = [device.index] if device.type == "cuda" else None
    # No buffer to sync (the sinusoid table is constant; LayerNorm keeps no statistics).
    ddp = DDP(model, device_ids=ids, broadcast_buffers=False, gradient_as_bucket_view=True)
    if grad_compression == "bf16":
        # Halves all-reduce bytes between nodes; gradients are averaged in bf16 (lossy).
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    return ddp
