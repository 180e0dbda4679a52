"""How §3's layers are computed, beside the formulas `model.transformer` writes: the layout of
the tensors around attention (its heads, the real positions, the `Mask` each attention call gets)
and the kernels the layers call (dropout, attention, the residual add). Nothing here learns, and
each piece computes what the paper's (B, T, d) formula computes.

Heads (Table 3 rows A, B: d_k and d_v independent of d_model / h). The fused projections keep one
tensor layout for every variant: each head's q, k, v are zero-padded to hs = max(d_k, d_v). Zero
columns change no dot product, SDPA is given d_k^-0.5 as its scale (§3.2.1) when keys are padded,
and the padded value columns are dropped before W_O, so the result is the paper's attention exactly
(tests/unit/model/test_variants.py).

Real positions (right padding). Position-wise work (projections, FFN, LayerNorm, dropout) runs on
the M real positions only, as (M, d) rows (`Positions.pack`); attention scatters them back into
(B, T, .) (`Positions.unpack`). Outputs at pad positions are never computed. An attention block
learns of it only through its `Mask`: `Mask.split_heads` and `Mask.merge_heads` do the scatter and
the gather with the heads' split and merge, and are the heads' alone when the stream is (B, T, d).
Boolean attention masks follow `F.scaled_dot_product_attention`: True = this key may be attended to.

Kernels. `Dropout` is the paper's dropout (§5.4) with a cheaper mask for CPU tensors, chosen per
module by its `cpu_kernel` option (`Transformer(cfg, cpu_kernels=...)` passes it down); `sdpa` is
`F.scaled_dot_product_attention` with bf16 attention that needs gradients run in fp32 on a CPU;
`add_into` adds the residual stream in the sublayer output's memory. Each computes what the plain
PyTorch op computes (dropout up to its mask, see `_CpuDropout`); docs/benchmarks.md has their
measurements (`benchmarks/cpu_step_bench.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


def pad_heads(x: torch.Tensor, hs: int) -> torch.Tensor:
    """(..., w) -> (..., hs): zero columns after the w real ones (no copy when w == hs)."""
    return x if x.shape[-1] == hs else F.pad(x, (0, hs - x.shape[-1]))


class Heads:
    """Per-head widths of one attention block: d_k, d_v, hs = max(d_k, d_v), SDPA's scale."""

    def __init__(self, d_model: int, n_heads: int, d_k: int | None, d_v: int | None):
        self.n_heads = n_heads
        self.d_k, self.d_v = d_k or d_model // n_heads, d_v or d_model // n_heads
        self.hs = max(self.d_k, self.d_v)
        self.uniform = self.d_k == self.d_v
        # §3.2.1: scores / sqrt(d_k); SDPA's default 1/sqrt(hs) is that unless keys are padded.
        self.scale = None if self.d_k == self.hs else self.d_k ** -0.5

    def split(self, x: torch.Tensor, sizes: tuple[int, ...]) -> torch.Tensor:
        """(B, T, h * sum(sizes)) fused projections -> (len(sizes), B, h, T, hs), each part padded."""
        B, T, _ = x.shape
        h = self.n_heads
        if all(w == self.hs for w in sizes):
            return x.view(B, T, len(sizes), h, self.hs).permute(2, 0, 3, 1, 4)
        parts = x.split([h * w for w in sizes], dim=-1)
        return torch.stack([pad_heads(p.view(B, T, h, w), self.hs) for p, w in zip(parts, sizes)]).permute(
            0, 1, 3, 2, 4)

    def split_queries(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, h * d_k) one projection -> (B, h, T, hs), padded when d_k < d_v."""
        B, T, _ = x.shape
        return pad_heads(x.view(B, T, self.n_heads, self.d_k).transpose(1, 2), self.hs)

    def merge(self, y: torch.Tensor) -> torch.Tensor:
        """SDPA output (B, h, T, hs) -> (B, T, h * d_v), the padded value columns dropped."""
        return merge_heads(y if self.d_v == self.hs else y[..., : self.d_v])


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    B, h, T, hs = x.shape
    return x.transpose(1, 2).reshape(B, T, h * hs)  # (B, T, d)


def key_padding_to_attn_mask(pad_mask: torch.Tensor) -> torch.Tensor:
    """(B, S) bool True = pad  ->  (B, 1, 1, S) bool True = may attend (SDPA convention)."""
    return ~pad_mask[:, None, None, :]


class Positions:
    """The M real (non-pad) positions of a right-padded (B, T) batch: `index` (M,) long holds
    their flat positions b * T + t, row-major."""

    def __init__(self, keep: torch.Tensor, index: torch.Tensor | None = None):  # (B, T) bool, True = real
        self.B, self.T = keep.shape
        # `nonzero` waits for the device (its size is data-dependent): training passes the index
        # computed on the host with the batch (`index`, the same positions), so a step never syncs.
        self.index = keep.reshape(-1).nonzero()[:, 0] if index is None else index  # (M,)

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """(M, c) -> (B, T, c), zeros at pad positions."""
        return x.new_zeros(self.B * self.T, x.shape[1]).index_copy(0, self.index, x).view(self.B, self.T, -1)

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, ...) -> (M, ...)."""
        return x.reshape(self.B * self.T, *x.shape[2:]).index_select(0, self.index)


class Mask:
    """What one attention call may see (§3.2.3), and where its batch's positions are.

    `keys` (B, 1, 1, S) bool, True = the key may be attended to (the source's padding), or None;
    `causal`: the query at position t sees the keys at positions <= t only (the decoder's
    self-attention: right padding puts every pad key after every real query, so this suffices).
    `at`: the residual stream around this attention holds its queries' batch as the M real
    positions' (M, d) rows (`Positions`); None: as (B, T, d)."""

    def __init__(self, keys: torch.Tensor | None = None, causal: bool = False, at: Positions | None = None):
        self.keys, self.causal, self.at = keys, causal, at

    def split_heads(self, x: torch.Tensor, heads: Heads, sizes: tuple[int, ...]) -> torch.Tensor:
        """Fused projections of the stream, (B, T, h * sum(sizes)) or (M, ...) -> (len(sizes), B, h, T, hs)."""
        return heads.split(self.unpack(x), sizes)

    def split_queries(self, x: torch.Tensor, heads: Heads) -> torch.Tensor:
        """One projection of the stream, (B, T, h * d_k) or (M, ...) -> (B, h, T, hs)."""
        return heads.split_queries(self.unpack(x))

    def merge_heads(self, y: torch.Tensor, heads: Heads) -> torch.Tensor:
        """Attention's output (B, h, T, hs) -> the stream's (B, T, h * d_v), or its (M, h * d_v) rows."""
        return self.pack(heads.merge(y))

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, ...) -> the stream: as it is, or its real positions' (M, ...) rows."""
        return x if self.at is None else self.at.pack(x)

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """The stream -> (B, T, ...), zeros at pad positions."""
        return x if self.at is None else self.at.unpack(x)


def source_mask(src_ids: torch.Tensor, pad_id: int, index: torch.Tensor | None = None) -> Mask:
    """The encoder's self-attention over src_ids (B, S): pad keys masked, the stream at the real
    positions (`index`: their flat positions, when the caller has them; else found here). Its keys
    are the cross-attention's too."""
    pad = src_ids.eq(pad_id)  # (B, S)
    return Mask(keys=key_padding_to_attn_mask(pad), at=Positions(~pad, index))


def target_masks(tgt_in_ids: torch.Tensor, pad_id: int, source: Mask, nonpad: NonPad | None
                 ) -> tuple[Mask, Mask]:
    """The decoder's self-attention (causal) and cross-attention (the source's keys) over
    tgt_in_ids (B, T): the stream at the real positions with `nonpad`, else (B, T, d)."""
    at = None if nonpad is None else Positions(tgt_in_ids.ne(pad_id), nonpad.tgt_index)
    return Mask(causal=True, at=at), Mask(keys=source.keys, at=at)


@dataclass(frozen=True)
class NonPad:
    """`Transformer.forward`'s request to compute the decoder at the non-pad target positions only
    (the loss needs no other), with the flat non-pad positions of the source and the decoder input
    when the caller has them (`pipeline.train.feeder.collate` computes them on the host, so a
    step needs no device-to-host sync to find them); None: found on the device."""

    src_index: torch.Tensor | None = None  # (Ms,) flat non-pad positions of src_ids
    tgt_index: torch.Tensor | None = None  # (M,) flat non-pad positions of tgt_in_ids


# The kernels

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
