"""Dev-set loss and perplexity during training (`metrics.val_loss_interval_steps`), in the workers.

Each worker takes a stride of the dev batches and the sums are added over the workers in the
step's agreement (`pipeline.train.agreement`), so the dev loss costs
about one forward pass over the dev set split over the workers; pairs longer than the model's
positions are left out. The model is put back in training mode afterwards. (Dev BLEU per
checkpoint is another thing: `pipeline.train.dev_bleu_validation`, Ray Train's validation.)

On a GPU the dev batches take the training steps' shapes and loss: padded to the same
`ShapeBuckets` (dev batches are not repeated within one evaluation, so without buckets every one
is a shape the kernels are chosen for anew), and the same `LossSettings` (with `speed.fused_loss`,
the fused projection + loss: no (M, V) logits). Both change no figure
(tests/unit/train/test_dev_loss.py).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from model import ModelConfig
from pipeline.batch_plan import step_groups
from pipeline.batch_plan.shapes import ShapeBuckets
from pipeline.train import feeder
from pipeline.train.corpus import Corpus
from pipeline.train.feeder import to_device
from pipeline.train.step import LossSettings, TrainedModel, micro_batch_loss


class DevLoss:
    """Loss, nll and perplexity per target token on the dev split: this worker's sums (`sums`),
    then the metrics of the sums added over the workers (`metrics`)."""

    def __init__(self, data: Corpus, mcfg: ModelConfig, max_tokens: int, loss: LossSettings, rank: int,
                 world: int, device: torch.device, buckets: ShapeBuckets | None = None):
        """`loss`: the training steps' (`step.micro_batch_loss`; its scaler is unused here);
        `buckets`: pad each dev batch to its bucketed shape (`speed.shape_buckets`)."""
        self.data, self.loss, self.rank, self.world, self.device = data, loss, rank, world, device
        self.layout = feeder.BatchLayout.of(mcfg, buckets=buckets)
        d, limit = data, mcfg.max_positions
        rows = np.flatnonzero((d.src_len + 1 <= limit) & (d.tgt_len + 1 <= limit))
        self.batches = step_groups.plan_eval_batches(rows, d.src_len, d.tgt_len, max_tokens)

    @torch.no_grad()
    def sums(self, model: TrainedModel | torch.nn.Module) -> torch.Tensor:
        """(3,) float64 on the device: loss, nll and target tokens of this worker's stride of the
        batches; of the worker's model as compiled, outside DDP (no gradient to reduce)."""
        d = self.data
        inner = model.compiled if isinstance(model, TrainedModel) else model
        inner.eval()
        sums = torch.zeros(3, dtype=torch.float64, device=self.device)
        for rows in self.batches[self.rank::self.world]:
            b = feeder.collate(rows, d, self.layout)
            # Real positions only, found on the host (as in training): no `nonzero` in the model,
            # which would break a compiled model's graph into pieces specialized per batch.
            loss, nll = micro_batch_loss(inner, to_device(b, self.device), self.loss)
            sums += torch.stack([loss.double(), nll.double(), torch.tensor(float(b.num_tgt_tokens),
                                 dtype=torch.float64, device=self.device)])
        inner.train()
        return sums

    @staticmethod
    def metrics(sums: list[float]) -> dict[str, float] | None:
        """val/loss, val/nll, val/ppl of the workers' added `sums`; None when there were no target tokens."""
        loss, nll, n = sums
        if n == 0:
            return None
        return {"val/loss": loss / n, "val/nll": nll / n, "val/ppl": math.exp(min(nll / n, 50.0))}
