"""Dev-set loss and perplexity during training (`train.eval_interval_steps`), in the workers.

Each worker takes a stride of the dev batches and the sums are all-reduced, so validation costs
about one forward pass over the dev set split over the workers; pairs longer than the model's
positions are left out. The model is put back in training mode afterwards.

On a GPU the dev batches take the training steps' shapes and loss: padded to the same
`ShapeBuckets` (dev batches are not repeated within a validation, so without buckets every one
is a shape the kernels choose for anew: issue 37), and the fused projection + loss
(`train.fused_loss`: no (M, V) logits). Both change no figure (tests/unit/train/test_validate.py).
"""

from __future__ import annotations

import math
from typing import Callable, ContextManager

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from model import ModelConfig
from pipeline.plan import step_groups
from pipeline.train import token_batches
from pipeline.train.corpus import Corpus
from pipeline.train.metrics import all_reduce_sum
from pipeline.plan.shapes import ShapeBuckets
from pipeline.train.step import micro_batch_loss, to_device


class Validator:
    """Loss, nll and perplexity per target token on the dev split; `None` on ranks other than 0."""

    def __init__(self, data: Corpus, mcfg: ModelConfig, max_tokens: int, label_smoothing: float,
                 autocast: Callable[[], ContextManager], rank: int, world: int, device: torch.device,
                 buckets: ShapeBuckets | None = None, fused_output: tuple[torch.Tensor, torch.dtype] | None = None):
        """`buckets`: pad each dev batch to its bucketed shape (`train.shape_buckets`); `fused_output`:
        the fused projection + loss, as the steps compute it (`step.micro_batch_loss`, `train.fused_loss`)."""
        self.data, self.mcfg, self.label_smoothing, self.autocast = data, mcfg, label_smoothing, autocast
        self.rank, self.world, self.device = rank, world, device
        self.buckets, self.fused_output = buckets, fused_output
        d, limit = data, mcfg.max_positions
        rows = np.flatnonzero((d.src_len + 1 <= limit) & (d.tgt_len + 1 <= limit))
        self.batches = step_groups.plan_eval_batches(rows, d.src_len, d.tgt_len, max_tokens)

    @torch.no_grad()
    def __call__(self, model: torch.nn.Module) -> dict[str, float] | None:
        d, m = self.data, self.mcfg
        inner = model.module if isinstance(model, DDP) else model
        inner.eval()
        sums = torch.zeros(3, dtype=torch.float64, device=self.device)
        for rows in self.batches[self.rank::self.world]:
            b = token_batches.collate(rows, d.src_values, d.src_offsets, d.tgt_values, d.tgt_offsets,
                                 m.pad_id, m.bos_id, m.eos_id, max_width=m.max_positions, buckets=self.buckets)
            # Real positions only, found on the host (as in training): no `nonzero` in the model,
            # which would break a compiled model's graph into pieces specialized per batch.
            loss, nll = micro_batch_loss(inner, to_device(b, self.device), self.label_smoothing, m.pad_id,
                                         self.autocast, self.fused_output)
            sums += torch.stack([loss.double(), nll.double(), torch.tensor(float(b.num_tgt_tokens),
                                 dtype=torch.float64, device=self.device)])
        inner.train()
        loss, nll, n = all_reduce_sum(sums, self.device, self.world)
        if self.rank != 0 or n == 0:
            return None
        return {"val/loss": loss / n, "val/nll": nll / n, "val/ppl": math.exp(min(nll / n, 50.0))}
