"""One optimizer step of the paper's recipe (§5.3, §5.4): pure torch, no Ray, no data loading.

The update is the gradient of

    loss_step = (sum over the step's target tokens, all micro-batches, all workers, of the
                 label-smoothed loss) / N

whatever the split into micro-batches and workers: each worker back-propagates
`loss_sum(micro) * world_size / N` (DDP averages gradients over workers, i.e. divides by
world_size) and skips DDP's all-reduce on all but its last micro-batch (`no_sync`). N, the
step's target-token count, is known to every worker from the global batch plan
(`pipeline.batch_plan.step_groups`), so no all-reduce of the token count is needed.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, ContextManager

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from model import NonPad, label_smoothed_nll, linear_label_smoothed_nll
from pipeline.train.feeder import MicroBatch


def step_seed(seed: int, rank: int, step: int) -> int:
    """Dropout RNG seed of (worker, step): resuming at any step replays the same masks."""
    return int(np.random.SeedSequence([seed, rank, step]).generate_state(1, np.uint64)[0] % (2**63))


@dataclass(frozen=True)
class FusedOutput:
    """The output projection fused with the loss (`speed.fused_loss`, on GPUs): the model returns its
    last hidden states and `model.linear_label_smoothed_nll` projects and scores them in chunks, never
    holding the (M, V) logits."""

    weight: torch.Tensor  # (V, d_model): the output projection's weight (tied with the embeddings)
    dtype: torch.dtype  # what the projection multiplies in: the autocast dtype, or float32


@dataclass(frozen=True, kw_only=True)
class LossSettings:
    """How a micro-batch's loss is computed, the same in the training steps and the dev loss."""

    label_smoothing: float  # ε_ls (§5.4: 0.1; train.label_smoothing)
    pad_id: int  # target positions of this id are no tokens (the loss ignores them)
    autocast: Callable[[], ContextManager] = contextlib.nullcontext  # the forward's precision context
    scaler: torch.amp.GradScaler | None = None  # fp16 loss scaling of the backward (training only)
    fused_output: FusedOutput | None = None  # None: the model's logits, then the loss


def micro_batch_loss(model: torch.nn.Module, mb: MicroBatch, settings: LossSettings
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss_sum, nll_sum) of one micro-batch at its real target positions: the model under
    `settings.autocast`, then the label-smoothed loss of its logits (projected under autocast too),
    or with `settings.fused_output` the projection fused with the loss (`FusedOutput`: no (M, V)
    logits). The training steps and the dev loss both compute it so.

    `model` is the Transformer (or it under torch.compile), or the worker's `TrainedModel`, whose
    call goes through DDP; `model.logits` is the Transformer's own projection either way."""
    epsilon, pad_id, autocast, fused_output = (settings.label_smoothing, settings.pad_id, settings.autocast,
                                               settings.fused_output)
    # (M,): the projection skips pad positions. A boolean index would wait for the device to learn
    # M; collate gives the target and the positions, computed on the host.
    target = mb.target if mb.target is not None else mb.tgt_out[mb.tgt_out != pad_id]
    with autocast():
        hidden = model(mb.src, mb.tgt_in, NonPad(mb.src_index, mb.tgt_index))  # (M, d)
        logits = model.logits(hidden) if fused_output is None else None  # (M, V)
    if fused_output is None:
        return label_smoothed_nll(logits, target, epsilon=epsilon, ignore_index=pad_id, overwrite_logits=True)
    return linear_label_smoothed_nll(hidden, fused_output.weight, target, epsilon, pad_id, fused_output.dtype)


class TrainedModel:
    """The one handle to the model a worker trains.

    `module` is the Transformer: its parameters are what the optimizer steps, the norm clips and
    the checkpoint saves. `compiled` is what a forward runs: `module`, or it under torch.compile
    (speed.compile; the dev loss runs it too). Calling the handle runs the step's forward:
    `compiled`, inside DDP once `distribute` wraps it for more than one worker (DDP prepares the
    gradients' all-reduce in forward). `logits` is the module's own output projection, outside
    forward (its gradient still reaches DDP through autograd)."""

    def __init__(self, module: torch.nn.Module, compiled: torch.nn.Module | None = None):
        self.module = module
        self.compiled = module if compiled is None else compiled
        self.step_forward: torch.nn.Module = self.compiled

    def distribute(self, device: torch.device, world: int, grad_compression: str, always: bool = False) -> None:
        self.step_forward = distributed(self.compiled, device, world, grad_compression, always)

    def __call__(self, *args: Any) -> torch.Tensor:
        return self.step_forward(*args)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.module.logits(hidden)

    def parameters(self) -> Any:
        return self.module.parameters()

    def train(self) -> None:
        self.step_forward.train()

    def no_sync(self) -> ContextManager:
        """DDP's: no all-reduce in this backward (a micro-batch before the step's last)."""
        return self.step_forward.no_sync() if isinstance(self.step_forward, DDP) else contextlib.nullcontext()


def accumulate_gradients(model: torch.nn.Module, micro_batches: list[MicroBatch], step_tgt_tokens: int,
                         world_size: int, settings: LossSettings) -> tuple[torch.Tensor, torch.Tensor]:
    """Back-propagate this worker's share of the step; return its (loss_sum, nll_sum) (detached).

    After the last micro-batch (and DDP's all-reduce) every worker holds
    d/dθ [ sum of token losses over the whole step / step_tgt_tokens ].
    """
    scale, scaler = world_size / step_tgt_tokens, settings.scaler
    loss_total = torch.zeros((), device=micro_batches[0].src.device)
    nll_total = torch.zeros((), device=micro_batches[0].src.device)
    for i, mb in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        sync = contextlib.nullcontext() if last or not hasattr(model, "no_sync") else model.no_sync()
        with sync:
            loss, nll = micro_batch_loss(model, mb, settings)
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
