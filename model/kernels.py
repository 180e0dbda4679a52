"""CPU kernels and memory-saving elementwise steps of the Transformer, beside the architecture.

`Dropout` is the paper's dropout (§5.4) with a cheaper mask for CPU tensors, chosen per module
by its `cpu_kernel` option (`Transformer(cfg, cpu_kernels=...)` passes it down); `sdpa` is
`F.scaled_dot_product_attention` with bf16 attention that needs gradients run in fp32 on a CPU;
`add_into` adds the residual stream in the sublayer output's memory. Each computes what the
plain PyTorch op computes (dropout up to its mask, see `_CpuDropout`); docs/benchmarks.md has
their measurements (`benchmarks/cpu_step_bench.py`).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class _CpuDropout(torch.autograd.Function):
    """Inverted dropout whose mask costs a quarter of the random draws of `torch.bernoulli_`: one
    64-bit draw gives four 15-bit uniforms (Tensor.random_ on int64 fills bits 0-62; each int16 lane
    is masked to its low 15 bits), so p is rounded to a multiple of 2^-15 (0.1 -> 0.100006) and
    kept values are scaled by 1 / (1 - that p). Only the bool mask is saved, as in `F.dropout`.
    It draws from torch's default CPU generator, so `torch.manual_seed` makes it repeatable, but
    its masks differ from F.dropout's."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, p: float) -> torch.Tensor:
        n = x.numel()
        bits = torch.empty((n + 3) // 4, dtype=torch.int64).random_().view(torch.int16)[:n]
        dropped = round(p * 32768)
        keep = (bits & 0x7FFF).ge(dropped).view(x.shape)
        ctx.save_for_backward(keep)
        ctx.scale = 32768 / (32768 - dropped)
        return x.mul(keep).mul_(ctx.scale)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (keep,) = ctx.saved_tensors
        return grad.mul(keep).mul_(ctx.scale), None


class Dropout(nn.Dropout):
    """`nn.Dropout` (§5.4); with `cpu_kernel`, `_CpuDropout`'s cheaper mask for CPU tensors in
    eager training. On a GPU, and under torch.compile (dynamo re-specializes on its draws: 30
    graphs where 2 do), PyTorch's own. `cpu_kernel=False`: PyTorch's everywhere, e.g. for an eager
    model compared with a compiled one.

    Deviation: with the CPU kernel, p is rounded to a multiple of 2^-15 (0.1 -> 0.100006) because
    one 64-bit draw then gives four masks' worth of uniforms (a quarter of the random draws)."""

    def __init__(self, p: float = 0.5, cpu_kernel: bool = True):
        super().__init__(p)
        self.cpu_kernel = cpu_kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (self.cpu_kernel and self.training and 0 < self.p < 1 and x.device.type == "cpu" and not self.inplace
                and not torch.compiler.is_compiling()):
            return _CpuDropout.apply(x, self.p)
        return super().forward(x)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, cpu_kernel={self.cpu_kernel}"


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw) -> torch.Tensor:
    """`F.scaled_dot_product_attention`, but in fp32 for bf16 inputs on CPU that need gradients:
    torch's CPU flash-attention backward in bf16 is several times slower than in fp32, which
    makes a bf16 training step slower than an fp32 one at small d_model; the matmuls around it
    stay bf16 (docs/benchmarks.md). Autocast is off inside: it would cast the fp32 inputs back."""
    if q.dtype == torch.bfloat16 and q.device.type == "cpu" and q.requires_grad:  # (False under no_grad)
        with torch.autocast("cpu", enabled=False):
            return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), **kw).to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, **kw)


def add_into(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """y + x, in place in y unless that would round the sum to y's narrower dtype (autocast:
    a bf16 sublayer output plus the fp32 residual stream). y must be a fresh output that autograd
    does not need (a sublayer's or dropout's)."""
    return y.add_(x) if y.dtype == x.dtype else x + y
