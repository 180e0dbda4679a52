"""Model FLOPs of one training step, counted by torch's own FLOP counter on the real model.

`count_step_flops` runs the Transformer's forward, the label-smoothed loss and the backward of
every micro-batch of a step under `torch.utils.flop_counter.FlopCounterMode`, on PyTorch's
``meta`` device: the real modules at their real shapes, with no memory and no arithmetic, so a
base step of 25k target tokens is counted in well under a second. What the counter counts:
every matmul (the Q/K/V/O projections, the FFN, the output projection over the vocabulary) and
attention (SDPA's scores and weighted sums, at the padded (B, h, T, S) shapes the kernel
computes), forward and backward; elementwise work (softmax, LayerNorm, dropout, the loss, Adam)
is left out, as in every MFU figure. The backward of a matmul counts twice its forward.

Shapes come from lengths alone (`MicroShape`): a micro-batch of B pairs padded to S source and
T target columns, with Ms and Mt real positions (the model computes position-wise work on those
only, `model.transformer.Packing`), as `pipeline.train.batching.collate` builds it on a GPU
(no row rounding). Imports torch, numpy and the model only: benchmarks/gpu_check.py uses it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.flop_counter import FlopCounterMode

from model import ModelConfig, Transformer, label_smoothed_nll


@dataclass(frozen=True)
class MicroShape:
    """The shapes of one padded micro-batch (`batching.collate`, row_multiple 1)."""

    B: int  # pairs
    S: int  # source columns: the longest source + eos
    T: int  # target columns: the longest target + bos/eos
    Ms: int  # real source positions: sum of (source length + 1)
    Mt: int  # real target positions (the loss's tokens): sum of (target length + 1)

    @classmethod
    def of(cls, src_len: np.ndarray, tgt_len: np.ndarray) -> "MicroShape":
        """The micro-batch of pairs with these piece counts."""
        s, t = np.asarray(src_len, np.int64) + 1, np.asarray(tgt_len, np.int64) + 1
        return cls(len(s), int(s.max()), int(t.max()), int(s.sum()), int(t.sum()))


def count_step_flops(mc: ModelConfig, micro: list[MicroShape], label_smoothing: float = 0.1) -> int:
    """FLOPs of forward + loss + backward over `micro` (one step: every micro-batch of every worker)."""
    with torch.device("meta"):
        model = Transformer(mc)
    model.train()
    long = dict(dtype=torch.long, device="meta")
    with FlopCounterMode(display=False) as counter:
        for m in micro:
            if m.B == 0:
                continue
            src = torch.full((m.B, m.S), mc.eos_id, **long)
            tgt_in = torch.full((m.B, m.T), mc.bos_id, **long)
            logits = model(src, tgt_in, nonpad_only=True, src_index=torch.empty(m.Ms, **long),
                           tgt_index=torch.empty(m.Mt, **long))  # (Mt, V)
            loss, _ = label_smoothed_nll(logits, torch.full((m.Mt,), mc.eos_id, **long), epsilon=label_smoothing,
                                         ignore_index=mc.pad_id)
            loss.backward()
    return int(counter.get_total_flops())


def six_n_t(num_params: int, tgt_tokens: float) -> float:
    """The rule-of-thumb 6·N·T (Kaplan et al. 2020, §2.1: 2N forward + 4N backward per token) with
    N = all parameters and T = target tokens: it prices every parameter once per target token, so
    it leaves out attention scores, counts the embedding lookup as a matmul and ignores that the
    encoder runs over the source tokens instead. Printed beside the counted figure as a cross-check."""
    return 6.0 * num_params * tgt_tokens
