"""Model FLOPs of one training step, counted by torch's own FLOP counter on the real model.

`count_step_flops` runs the Transformer's forward, the label-smoothed loss and the backward of
every micro-batch of a step under `torch.utils.flop_counter.FlopCounterMode`, on PyTorch's
``meta`` device: the real modules at their real shapes, with no memory and no arithmetic (each
run still costs seconds of Python per micro-batch on a small CPU, whatever its size, so the bill
uses `step_flops`: six counted probes per model, then a linear form). What the counter counts:
every matmul (the Q/K/V/O projections, the FFN, the output projection over the vocabulary) and
attention (SDPA's scores and weighted sums, at the padded (B, h, T, S) shapes the kernel
computes), forward and backward; elementwise work (softmax, LayerNorm, dropout, the loss, Adam)
is left out, as in every MFU figure. The backward of a matmul counts twice its forward.

Shapes come from lengths alone (`MicroShape`): a micro-batch of B pairs padded to S source and
T target columns, with Ms and Mt real positions (the model computes position-wise work on those
only, `model.compute.Positions`), as `pipeline.train.feeder.collate` builds it on a GPU
(no row rounding). Imports torch, numpy and the model only: benchmarks/gpu_check.py uses it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from model import ModelConfig, NonPad, Transformer, label_smoothed_nll


@dataclass(frozen=True, kw_only=True)
class MicroShape:
    """The shapes of one padded micro-batch (`feeder.collate`, row_multiple 1)."""

    B: int  # pairs
    S: int  # source columns: the longest source + eos
    T: int  # target columns: the longest target + bos/eos
    Ms: int  # real source positions: sum of (source length + 1)
    Mt: int  # real target positions (the loss's tokens): sum of (target length + 1)

    @classmethod
    def of(cls, src_len: np.ndarray, tgt_len: np.ndarray) -> "MicroShape":
        """The micro-batch of pairs with these piece counts."""
        s, t = np.asarray(src_len, np.int64) + 1, np.asarray(tgt_len, np.int64) + 1
        return cls(B=len(s), S=int(s.max()), T=int(t.max()), Ms=int(s.sum()), Mt=int(t.sum()))


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
            hidden = model(src, tgt_in, NonPad(torch.empty(m.Ms, **long), torch.empty(m.Mt, **long)))
            logits = model.logits(hidden)  # (Mt, V)
            loss, _ = label_smoothed_nll(logits, torch.full((m.Mt,), mc.eos_id, **long), epsilon=label_smoothing,
                                         ignore_index=mc.pad_id)
            loss.backward()
    return int(counter.get_total_flops())


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched (each a kernel launch or more on a GPU, a host call on a CPU),
    and among them those that make the host wait for the device (a bool, an int, an item, a nonzero)."""

    WAITS = frozenset({"is_nonzero", "item", "_local_scalar_dense", "nonzero"})

    def __init__(self):
        super().__init__()
        self.count = 0
        self.waits = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        self.waits += func.overloadpacket.__name__ in self.WAITS
        return func(*args, **(kwargs or {}))


_ops: dict[tuple, int] = {}


def count_step_ops(mc: ModelConfig, label_smoothing: float = 0.1) -> int:
    """aten ops that one micro-batch's forward, loss and backward dispatch on a GPU's path: the
    host's work of an eager GPU micro-batch (each op a dispatch, most a kernel launch). The count is
    the model's structure (layers, heads, tying, positions), not its widths, vocabulary or batch,
    so it runs a model of this structure shrunk to 8 columns per head, for real on this CPU in fp32
    (milliseconds), with PyTorch's dropout and the loss in one piece as on a GPU. Not on the meta
    device: there SDPA decomposes into its math ops, where a GPU runs one fused kernel forward and
    one backward (as this CPU does). Cached per model."""
    key = (tuple(sorted(vars(mc).items())), label_smoothing)
    if key in _ops:
        return _ops[key]
    dk, dv = mc.head_dims
    heads = {} if mc.d_k is None and mc.d_v is None else {"d_k": 8 if dk <= dv else 16, "d_v": 8 if dv <= dk else 16}
    small = dataclasses.replace(mc, d_model=8 * mc.n_heads, d_ff=16, vocab_size=max(mc.pad_id, mc.bos_id, mc.eos_id) + 8,
                                max_positions=16, **heads)
    with torch.device("cpu"):
        model = Transformer(small, cpu_kernels=False).train()
    B, S, T = 2, 3, 3
    src = torch.full((B, S), small.eos_id)
    tgt = torch.full((B, T), small.bos_id)
    with OpCounter() as ops:
        logits = model.logits(model(src, tgt, NonPad(torch.arange(B * S), torch.arange(B * T))))
        loss, _ = label_smoothed_nll(logits, torch.full((B * T,), small.eos_id), epsilon=label_smoothing,
                                     ignore_index=small.pad_id, cpu_chunk_elements=1 << 40)
        loss.backward()
    _ops[key] = ops.count
    return ops.count


# A micro-batch's counted FLOPs are a sum of matmuls over its real positions (Ms source, Mt target
# rows: projections, FFN, output layer) and of attention over its padded shapes (B·S·S encoder,
# B·T·T decoder self, B·T·S cross), forward and backward: exactly a linear form in these five.
def _monomials(m: MicroShape) -> tuple[int, ...]:
    return (m.Ms, m.Mt, m.B * m.S * m.S, m.B * m.T * m.T, m.B * m.T * m.S)


# Five micro-batches whose monomials are linearly independent, and a sixth to check the form on.
_PROBES = (MicroShape(B=1, S=2, T=3, Ms=2, Mt=3), MicroShape(B=2, S=3, T=2, Ms=5, Mt=3),
           MicroShape(B=2, S=4, T=5, Ms=6, Mt=9),
           MicroShape(B=3, S=2, T=4, Ms=6, Mt=10), MicroShape(B=1, S=5, T=2, Ms=5, Mt=2))
_CHECK = MicroShape(B=3, S=7, T=6, Ms=15, Mt=14)
_forms: dict[tuple, np.ndarray | None] = {}


def _linear_form(mc: ModelConfig, label_smoothing: float) -> np.ndarray | None:
    """The five coefficients for this model, counted on `_PROBES` and checked on `_CHECK`; None
    if the check fails (a model change that the form no longer describes). Cached per model."""
    key = (tuple(sorted(vars(mc).items())), label_smoothing)
    if key not in _forms:
        counts = [count_step_flops(mc, [p], label_smoothing) for p in _PROBES]
        coef = np.linalg.solve(np.array([_monomials(p) for p in _PROBES], dtype=np.float64),
                               np.array(counts, dtype=np.float64))
        coef = np.rint(coef).astype(np.int64)
        exact = all(int(np.dot(coef, _monomials(p))) == c for p, c in zip(_PROBES, counts))
        check = count_step_flops(mc, [_CHECK], label_smoothing)
        _forms[key] = coef if exact and int(np.dot(coef, _monomials(_CHECK))) == check else None
    return _forms[key]


def step_flops(mc: ModelConfig, micro: list[MicroShape], label_smoothing: float = 0.1) -> int:
    """`count_step_flops`'s number without running the counter per micro-batch: the counter runs
    six times per model (each paying the meta device's per-op overhead) and every
    micro-batch is then a dot product; a bill samples dozens of micro-batches (steps x workers).
    Falls back to counting each micro-batch if the linear form does not hold for this model."""
    coef = _linear_form(mc, label_smoothing)
    if coef is None:
        return count_step_flops(mc, micro, label_smoothing)
    return int(sum(int(np.dot(coef, _monomials(m))) for m in micro if m.B))


def six_n_t(num_params: int, tgt_tokens: float) -> float:
    """The rule-of-thumb 6·N·T (Kaplan et al. 2020, §2.1: 2N forward + 4N backward per token) with
    N = all parameters and T = target tokens: it prices every parameter once per target token, so
    it leaves out attention scores, counts the embedding lookup as a matmul and ignores that the
    encoder runs over the source tokens instead. Printed beside the counted figure as a cross-check."""
    return 6.0 * num_params * tgt_tokens
