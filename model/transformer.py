"""Encoder-decoder Transformer (Vaswani et al., 2017, §3) with incremental decoding.

Sequence conventions (the data pipeline relies on them): source = pieces + [eos] (no bos);
decoder input = [bos] + pieces; decoder target = pieces + [eos]; right-padded with pad_id.

Shapes: B sentences, N = B * beam rows while decoding, S source length, T target length,
d = d_model, h = n_heads, d_k / d_v the per-head widths (d / h unless set, Table 3 A/B),
hs = max(d_k, d_v) the head width of the attention tensors and caches, V = vocab_size,
L = decoder cache length. When d_k != d_v, queries and keys (or values) are zero-padded to hs:
zero columns change no dot product, SDPA is given d_k^-0.5 as its scale (§3.2.1), and the
padded value columns are dropped before W_O, so the result is the paper's attention exactly.
Padding is on the right; `pad_id` marks it. Boolean attention masks follow
`F.scaled_dot_product_attention`: True = this key may be attended to.
"""

from __future__ import annotations

import contextlib
import math
import threading
from dataclasses import dataclass
from typing import Callable, ClassVar, Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import ModelConfig
from .heads import Heads as _Heads
from .heads import merge_heads as _merge_heads
from .heads import pad_heads as _pad_heads


def sinusoid_table(n_positions: int, d_model: int) -> torch.Tensor:
    """§3.5: PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d))."""
    pos = torch.arange(n_positions, dtype=torch.float64).unsqueeze(1)  # (P, 1)
    inv_freq = 10000.0 ** (-torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)  # (ceil(d/2),)
    table = torch.zeros(n_positions, d_model, dtype=torch.float64)
    table[:, 0::2] = torch.sin(pos * inv_freq)
    table[:, 1::2] = torch.cos(pos * inv_freq[: d_model // 2])
    return table.float()  # (P, d)


def _split_heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    B, T, d = x.shape
    return x.view(B, T, n_heads, d // n_heads).transpose(1, 2)  # (B, h, T, d / h)


def _init_linear(linear: nn.Linear, blocks: int | list[int] = 1) -> None:
    """xavier_uniform per stacked block of output rows (``blocks`` equal ones, or these row
    counts), so a fused Q/K/V projection is initialised like separate ones; bias 0."""
    if isinstance(blocks, int):
        blocks = [linear.weight.shape[0] // blocks] * blocks
    for block in linear.weight.split(blocks, dim=0):
        nn.init.xavier_uniform_(block)
    nn.init.zeros_(linear.bias)


class Packing:
    """Where the M real (non-pad) positions of a right-padded (B, T) batch sit: `index` (M,) long
    holds their flat positions b * T + t, row-major. Position-wise work (projections, FFN,
    LayerNorm, dropout) then runs on (M, d) rows only; attention scatters into (B, T, .) and
    gathers back. Outputs at pad positions are never computed."""

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


class _CpuDropout(torch.autograd.Function):
    """Inverted dropout whose mask costs a quarter of the random draws of `torch.bernoulli_`: one
    64-bit draw gives four 15-bit uniforms (Tensor.random_ on int64 fills bits 0-62; each int16 lane
    is masked to its low 15 bits), so p is rounded to a multiple of 2^-15 (0.1 -> 0.100006) and
    kept values are scaled by 1 / (1 - that p). Only the bool mask is saved, as in `F.dropout`.
    On a 2-core CPU a (2700, 256) bf16 dropout, forward and backward, takes 2.1 ms instead of 4.5
    (docs/benchmarks.md, `cpu_step_bench.py`); it draws from torch's default CPU
    generator, so `torch.manual_seed` makes it repeatable, but its masks differ from F.dropout's."""

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


CPU_DROPOUT = True  # False: PyTorch's dropout everywhere (tests that compare with a compiled model)


class Dropout(nn.Dropout):
    """`nn.Dropout` (§5.4), with `_CpuDropout`'s cheaper mask for CPU tensors in eager training.
    On a GPU, and under torch.compile (dynamo re-specializes on its draws: 30 graphs where 2 do),
    PyTorch's own."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (CPU_DROPOUT and self.training and 0 < self.p < 1 and x.device.type == "cpu" and not self.inplace
                and not torch.compiler.is_compiling()):
            return _CpuDropout.apply(x, self.p)
        return super().forward(x)


def _add_dropped(x: torch.Tensor, y: torch.Tensor, dropout: nn.Dropout) -> torch.Tensor:
    """x + dropout(y), in y's memory (a sublayer's fresh output; autograd needs neither value)."""
    if dropout.training and dropout.p > 0:
        y = dropout(y)
    return _add(y, x)


def _add(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """y + x, in place in y unless that would round the sum to y's narrower dtype (autocast:
    a bf16 sublayer output plus the fp32 residual stream)."""
    return y.add_(x) if y.dtype == x.dtype else x + y


_RECORDER = threading.local()  # this thread's `recording_attention` callback, if any


@contextlib.contextmanager
def recording_attention(record: Callable[..., None]) -> Iterator[None]:
    """Within it, every attention call of this thread first calls record(q, k, attn_mask,
    is_causal, scale) (`model.attention.attention_weights`). Thread-local: a server decoding other
    requests with the same model in other threads is neither seen nor disturbed."""
    _RECORDER.record = record
    try:
        yield
    finally:
        _RECORDER.record = None


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw) -> torch.Tensor:
    """`F.scaled_dot_product_attention`, but in fp32 for bf16 inputs on CPU that need gradients:
    torch 2.13's CPU flash-attention backward in bf16 is ~7x slower than in fp32 (24 vs 3.3 ms
    at B 64, h 4, T 40, hs 32), which made a bf16 training step slower than an fp32 one at
    d_model 128; the matmuls around it stay bf16. (Autocast would cast fp32 inputs back to bf16.)"""
    if not torch.compiler.is_compiling() and getattr(_RECORDER, "record", None) is not None:
        _RECORDER.record(q, k, kw.get("attn_mask"), kw.get("is_causal", False), kw.get("scale"))
    if q.dtype == torch.bfloat16 and q.device.type == "cpu" and q.requires_grad:  # (False under no_grad)
        with torch.autocast("cpu", enabled=False):
            return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), **kw).to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, **kw)


def key_padding_to_attn_mask(pad_mask: torch.Tensor) -> torch.Tensor:
    """(B, S) bool True = pad  ->  (B, 1, 1, S) bool True = may attend (SDPA convention)."""
    return ~pad_mask[:, None, None, :]


class SelfAttention(nn.Module):
    """Multi-head self-attention (§3.2.2); Q, K, V come from one fused (d, 3d) projection.

    Deviation: the Q/K/V/O projections have biases (the paper writes bare matrices W^Q...,
    tensor2tensor has none) because fairseq and torch.nn.MultiheadAttention, our test reference,
    have them; it adds 4 * d_model parameters per attention block.
    """

    def __init__(self, d_model: int, n_heads: int, d_k: int | None = None, d_v: int | None = None):
        super().__init__()
        self.n_heads = n_heads
        self.heads = _Heads(d_model, n_heads, d_k, d_v)
        dk, dv = self.heads.d_k, self.heads.d_v
        self.qkv_proj = nn.Linear(d_model, n_heads * (2 * dk + dv))  # rows: [W_Q; W_K; W_V], all heads
        self.out_proj = nn.Linear(n_heads * dv, d_model)  # W_O

    def reset_parameters(self) -> None:
        h, dk, dv = self.n_heads, self.heads.d_k, self.heads.d_v
        _init_linear(self.qkv_proj, [h * dk, h * dk, h * dv])
        _init_linear(self.out_proj)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False,
                cache: torch.Tensor | None = None, step: int = 0, packing: Packing | None = None) -> torch.Tensor:
        """x (B, T, d) -> (B, T, d). With `cache` (2, B, h, L, hs), T must be 1: the new K/V are
        written at position `step` and the query attends to positions 0..step (no mask needed).
        With `packing`, x and the result are the (M, d) real positions of a (B, T) batch."""
        hd = self.heads
        qkv = self.qkv_proj(x) if packing is None else packing.unpack(self.qkv_proj(x))  # (B, T, 3hs'), 0 at pads
        qkv = hd.split(qkv, (hd.d_k, hd.d_k, hd.d_v))
        q, k, v = qkv  # each (B, h, T, hs)
        if cache is not None:
            cache[:, :, :, step : step + 1] = qkv[1:]  # (2, B, h, 1, hs)
            k, v = cache[0, :, :, : step + 1], cache[1, :, :, : step + 1]  # (B, h, step+1, hs)
        y = _sdpa(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=hd.scale)
        y = hd.merge(y)  # (B, T, h * d_v)
        return self.out_proj(y if packing is None else packing.pack(y))


class CrossAttention(nn.Module):
    """Encoder-decoder attention (§3.2.3): queries from the decoder, keys/values from memory."""

    def __init__(self, d_model: int, n_heads: int, d_k: int | None = None, d_v: int | None = None):
        super().__init__()
        self.n_heads = n_heads
        self.heads = _Heads(d_model, n_heads, d_k, d_v)
        dk, dv = self.heads.d_k, self.heads.d_v
        self.q_proj = nn.Linear(d_model, n_heads * dk)
        self.kv_proj = nn.Linear(d_model, n_heads * (dk + dv))  # rows: [W_K; W_V]
        self.out_proj = nn.Linear(n_heads * dv, d_model)

    def reset_parameters(self) -> None:
        h, dk, dv = self.n_heads, self.heads.d_k, self.heads.d_v
        _init_linear(self.q_proj)
        _init_linear(self.kv_proj, [h * dk, h * dv])
        _init_linear(self.out_proj)

    def project_kv(self, memory: torch.Tensor, packing: Packing | None = None) -> torch.Tensor:
        """memory (B, S, d), or its (M, d) real positions with `packing` -> (2, B, h, S, hs)."""
        kv = self.kv_proj(memory) if packing is None else packing.unpack(self.kv_proj(memory))
        return self.heads.split(kv, (self.heads.d_k, self.heads.d_v))  # (2, B, h, S, hs)

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, d) -> (B, h, T, hs), padded to hs when d_k < d_v."""
        return _pad_heads(_split_heads(self.q_proj(x), self.n_heads), self.heads.hs)

    def forward(self, x: torch.Tensor, kv: torch.Tensor, attn_mask: torch.Tensor,
                packing: Packing | None = None) -> torch.Tensor:
        """x (N, T, d) with N = B * beam, sentence-major; kv (2, B, h, S, hs); attn_mask (B, 1, 1, S).
        With `packing` (beam 1), x and the result are the (M, d) real positions of a (B, T) batch."""
        hd = self.heads
        if packing is not None:
            q = _pad_heads(_split_heads(packing.unpack(self.q_proj(x)), self.n_heads), hd.hs)  # (B, h, T, hs)
            y = _sdpa(q, kv[0], kv[1], attn_mask=attn_mask, scale=hd.scale)
            return self.out_proj(packing.pack(hd.merge(y)))
        N, T, d = x.shape
        B = kv.shape[1]
        # The beams of one sentence share its memory, so they are folded into the query axis
        # instead of copying K/V beam times: (N, T, d) -> (B, beam * T, d).
        q = self._queries(x.reshape(B, (N // B) * T, d))  # (B, h, beam*T, hs)
        y = _sdpa(q, kv[0], kv[1], attn_mask=attn_mask, scale=hd.scale)
        return self.out_proj(hd.merge(y)).view(N, T, d)


class FeedForward(nn.Module):
    """FFN(x) = max(0, x W1 + b1) W2 + b2 (§3.3)."""

    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.w1 = nn.Linear(d_model, d_ff)
        self.w2 = nn.Linear(d_ff, d_model)

    def reset_parameters(self) -> None:
        _init_linear(self.w1)
        _init_linear(self.w2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.relu(self.w1(x), inplace=True))


class EncoderLayer(nn.Module):
    """Post-norm block (§3.1): x = LayerNorm(x + Dropout(Sublayer(x))) (§5.4).

    Deviation: LayerNorm eps is PyTorch's 1e-5 (tensor2tensor: 1e-6; the paper gives none)
    because it matches the torch.nn reference layers the tests compare against.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = SelfAttention(cfg.d_model, cfg.n_heads, cfg.d_k, cfg.d_v)
        self.norm1 = nn.LayerNorm(cfg.d_model)
        self.ffn = FeedForward(cfg.d_model, cfg.d_ff)
        self.norm2 = nn.LayerNorm(cfg.d_model)
        self.dropout = Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None,
                packing: Packing | None = None) -> torch.Tensor:  # (B, S, d), or (M, d) with packing
        x = self.norm1(_add_dropped(x, self.self_attn(x, attn_mask, packing=packing), self.dropout))
        return self.norm2(_add_dropped(x, self.ffn(x), self.dropout))


class DecoderLayer(nn.Module):
    """Post-norm block with masked self-attention, cross-attention and FFN (§3.1)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = SelfAttention(cfg.d_model, cfg.n_heads, cfg.d_k, cfg.d_v)
        self.norm1 = nn.LayerNorm(cfg.d_model)
        self.cross_attn = CrossAttention(cfg.d_model, cfg.n_heads, cfg.d_k, cfg.d_v)
        self.norm2 = nn.LayerNorm(cfg.d_model)
        self.ffn = FeedForward(cfg.d_model, cfg.d_ff)
        self.norm3 = nn.LayerNorm(cfg.d_model)
        self.dropout = Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, cross_kv: torch.Tensor, cross_mask: torch.Tensor,
                self_mask: torch.Tensor | None = None, is_causal: bool = False,
                cache: torch.Tensor | None = None, step: int = 0,
                packing: Packing | None = None) -> torch.Tensor:  # (N, T, d), or (M, d) with packing
        x = self.norm1(_add_dropped(x, self.self_attn(x, self_mask, is_causal, cache, step, packing), self.dropout))
        x = self.norm2(_add_dropped(x, self.cross_attn(x, cross_kv, cross_mask, packing), self.dropout))
        return self.norm3(_add_dropped(x, self.ffn(x), self.dropout))


@dataclass
class DecoderState:
    """Caches for incremental decoding (`Transformer.decode_step`), updated in place.

    Rows are sentence-major: row r = b * beam_size + j is beam j of sentence b. The self-attention
    cache is preallocated for `max_len` fed tokens, so a step writes one slot instead of
    concatenating; the cross-attention K/V are computed once and stored once per sentence.
    """

    self_kv: torch.Tensor  # (n_layers, 2, N, h, max_len, hs); slots < step are valid
    cross_kv: torch.Tensor  # (n_layers, 2, B, h, S, hs), shared by a sentence's beams
    cross_mask: torch.Tensor  # (B, 1, 1, S) bool, True = real source token
    output_weight_t: torch.Tensor  # (d, V) contiguous copy of output_proj.weight.T: for the few
    # rows of a decoding step, x @ W_t runs ~25% faster on CPU (MKL) than F.linear's x @ W.T
    beam_size: int
    step: int = 0  # tokens fed so far = position of the next token
    spare_kv: torch.Tensor | None = None  # reorder's target buffer, swapped with self_kv
    # per decoder layer, `_step_params(layer)` (transposed weight copies, biases, norms) for the
    # eval-mode step; None: decode_step runs the modules (always so in train mode)
    layer_weights_t: list[tuple] | None = None
    # decode_step accepts one row per sentence at step 0 (see Transformer.decode_step)
    first_step_per_sentence: ClassVar[bool] = True
    # reorder takes `sentences`: beam search drops finished sentences from every cache
    drops_sentences: ClassVar[bool] = True

    @classmethod
    def start(cls, model: "Transformer", memory: torch.Tensor, src_pad_mask: torch.Tensor, beam_size: int,
              max_len: int | None) -> "DecoderState":
        """`Transformer.init_decoder_state`: the caches of `model`'s decoder layers for memory
        (B, S, d), `beam_size` rows per sentence, up to `max_len` fed tokens."""
        cfg, layers = model.cfg, model.decoder_layers
        max_len = cfg.max_positions if max_len is None else max_len
        if not 0 < max_len <= cfg.max_positions:
            raise ValueError(f"max_len={max_len} must be in [1, max_positions={cfg.max_positions}]")
        B, S, d = memory.shape
        h, heads = cfg.n_heads, layers[0].self_attn.heads
        packing = Packing(~src_pad_mask)  # K/V only at real source positions (0 at padding, masked)
        memory = packing.pack(memory)  # (Ms, d)
        cross_kv = torch.stack([layer.cross_attn.project_kv(memory, packing) for layer in layers])
        self_kv = cross_kv.new_empty(len(layers), 2, B * beam_size, h, max_len, heads.hs)
        output_weight_t = model.output_proj.weight.t().contiguous()
        layer_weights_t = None
        if not model.training and heads.uniform:  # the fast step assumes d_k = d_v
            layer_weights_t = [_step_params(layer) for layer in layers]
        return cls(self_kv, cross_kv, key_padding_to_attn_mask(src_pad_mask), output_weight_t, beam_size,
                   layer_weights_t=layer_weights_t)

    def reorder(self, indices: torch.Tensor, sentences: torch.Tensor | None = None) -> None:
        """Row r takes the history of row indices[r] (beam search). indices (N,) long must keep
        every row within its own sentence, i.e. indices[r] // beam_size == r // beam_size.
        Gathers into a second buffer of self_kv's size (allocated on first use) and swaps the
        two: one pass over the cache instead of a gather and a copy back (2x faster on CPU).

        With ``sentences`` (B',) long, increasing: only those sentences stay (beam search drops the
        finished ones); indices (B' * beam_size,) then name rows of those sentences' blocks, in
        their order, and every cache shrinks to B' sentences (new buffers; the spare one is
        allocated again at the new size)."""
        t = self.step
        if sentences is not None:
            self.self_kv = _shrunk_cache(self.self_kv, indices, t)
            self.cross_kv = self.cross_kv.index_select(2, sentences)
            self.cross_mask = self.cross_mask.index_select(0, sentences)
            self.spare_kv = None
            return
        if t > 0 and self.self_kv.requires_grad:  # out= does not differentiate: gather and copy back
            self.self_kv[:, :, :, :, :t] = self.self_kv[:, :, :, :, :t].index_select(2, indices)
        elif t > 0:
            if self.spare_kv is None:
                self.spare_kv = torch.empty_like(self.self_kv)
            torch.index_select(self.self_kv[:, :, :, :, :t], 2, indices, out=self.spare_kv[:, :, :, :, :t])
            self.self_kv, self.spare_kv = self.spare_kv, self.self_kv


def _shrunk_cache(self_kv: torch.Tensor, indices: torch.Tensor, t: int) -> torch.Tensor:
    """A new self-attention cache of len(indices) rows, rows indices of self_kv's first t slots."""
    out = self_kv.new_empty(*self_kv.shape[:2], len(indices), *self_kv.shape[3:])
    if t > 0 and self_kv.requires_grad:  # out= does not differentiate
        out[:, :, :, :, :t] = self_kv[:, :, :, :, :t].index_select(2, indices)
    elif t > 0:
        torch.index_select(self_kv[:, :, :, :, :t], 2, indices, out=out[:, :, :, :, :t])
    return out


def _step_params(layer: DecoderLayer) -> tuple:
    """What `_decoder_layer_step` reads of a layer: each Linear as (contiguous W.T (d_in, d_out),
    bias), since for the few rows of a step addmm(b, x, W.T) beats F.linear's x @ W.T on CPU;
    each LayerNorm as (weight, bias). Fetched once per decoding, not per step and layer."""
    sa, ca, ffn = layer.self_attn, layer.cross_attn, layer.ffn
    linears = (sa.qkv_proj, sa.out_proj, ca.q_proj, ca.out_proj, ffn.w1, ffn.w2)
    norms = (layer.norm1, layer.norm2, layer.norm3)
    return ((sa.n_heads, sa.heads.hs, layer.norm1.eps) + tuple(t for m in linears for t in (m.weight.t().contiguous(), m.bias))
            + tuple(t for m in norms for t in (m.weight, m.bias)))


def _decoder_layer_step(params: tuple, x: torch.Tensor, cross_kv: torch.Tensor, cross_mask: torch.Tensor,
                        cache: torch.Tensor, step: int) -> torch.Tensor:
    """`DecoderLayer.forward` for one new token per row in eval mode (no dropout), on x (N, d),
    with `_step_params(layer)`; writes this step's K/V at `step` of cache (2, N, h, L, hs)."""
    (h, hs, eps, w_qkv, b_qkv, w_so, b_so, w_q, b_q, w_co, b_co, w_1, b_1, w_2, b_2,
     g_1, be_1, g_2, be_2, g_3, be_3) = params
    N, d = x.shape  # here d_k = d_v = hs (init_decoder_state uses the module path otherwise)
    qkv = torch.addmm(b_qkv, x, w_qkv).view(N, 3, h, hs)
    cache[:, :, :, step] = qkv[:, 1:].transpose(0, 1)  # (2, N, h, hs)
    y = F.scaled_dot_product_attention(qkv[:, 0, :, None], cache[0, :, :, : step + 1],
                                       cache[1, :, :, : step + 1])  # (N, h, 1, hs)
    x = torch.layer_norm(_add(torch.addmm(b_so, y.reshape(N, h * hs), w_so), x), (d,), g_1, be_1, eps)
    B = cross_kv.shape[1]  # a sentence's N // B beams are its queries (see CrossAttention)
    q = torch.addmm(b_q, x, w_q).view(B, N // B, h, hs).transpose(1, 2)  # (B, h, beam, hs)
    y = F.scaled_dot_product_attention(q, cross_kv[0], cross_kv[1], attn_mask=cross_mask)
    x = torch.layer_norm(_add(torch.addmm(b_co, y.transpose(1, 2).reshape(N, h * hs), w_co), x), (d,), g_2, be_2,
                         eps)
    y = torch.addmm(b_2, torch.addmm(b_1, x, w_1).relu_(), w_2)
    return torch.layer_norm(_add(y, x), (d,), g_3, be_3, eps)


class Transformer(nn.Module):
    """Transformer (§3): src (B, S) + decoder input (B, T) -> next-token logits (B, T, V)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        d = cfg.d_model
        self.src_embed = nn.Embedding(cfg.vocab_size, d)
        self.tgt_embed = self.src_embed if cfg.tie_embeddings else nn.Embedding(cfg.vocab_size, d)
        self.output_proj = nn.Linear(d, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:  # §3.4: one matrix for both embeddings and the pre-softmax projection
            self.output_proj.weight = self.src_embed.weight
        self.emb_scale = math.sqrt(d)  # §3.4: embeddings are multiplied by sqrt(d_model)
        # Not persistent: it is a pure function of the config, so checkpoints need not carry it.
        self.register_buffer("pos_table", sinusoid_table(cfg.max_positions, d), persistent=False)
        # Table 3 row E: learned positional embeddings (Gehring et al., cited in §3.5) in place of the
        # sinusoids; the sinusoid buffer then stays unused (it is not a parameter, not checkpointed).
        self.pos_embed = nn.Embedding(cfg.max_positions, d) if cfg.positional == "learned" else None
        self.dropout = Dropout(cfg.dropout)  # §5.4: on the sums of embeddings and positions
        self.encoder_layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.n_encoder_layers))
        self.decoder_layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.n_decoder_layers))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The paper gives no initialisation. Linear weights: xavier_uniform (fairseq, the
        Annotated Transformer, torch.nn.Transformer; tensor2tensor uses the close
        uniform_unit_scaling), per
        Q/K/V block of the fused projections so each gets the fan of a (d, d) matrix; biases 0.
        Embeddings (and an untied output projection): normal(0, d_model^-0.5) as fairseq does, so
        that embedding * sqrt(d_model) has unit scale; the pad row starts at 0 (fairseq)."""
        for module in self.modules():
            if isinstance(module, (SelfAttention, CrossAttention, FeedForward, nn.LayerNorm)):
                module.reset_parameters()
        for weight in {id(p): p for p in (self.src_embed.weight, self.tgt_embed.weight,
                                          self.output_proj.weight)}.values():
            nn.init.normal_(weight, mean=0.0, std=self.cfg.d_model ** -0.5)
            weight[self.cfg.pad_id].zero_()
        if self.pos_embed is not None:  # fairseq's LearnedPositionalEmbedding init (the paper gives none)
            nn.init.normal_(self.pos_embed.weight, mean=0.0, std=self.cfg.d_model ** -0.5)

    def num_parameters(self) -> int:
        """Trainable parameters, the shared embedding counted once."""
        return sum(p.numel() for p in self.parameters())

    def _embed(self, embed: nn.Embedding, ids: torch.Tensor, offset: int = 0) -> torch.Tensor:
        T = ids.shape[1]
        if offset + T > self.cfg.max_positions:
            raise ValueError(f"position {offset + T - 1} >= ModelConfig.max_positions={self.cfg.max_positions}")
        table = self.pos_table if self.pos_embed is None else self.pos_embed.weight
        x = embed(ids).mul_(self.emb_scale).add_(table[offset : offset + T])  # (B, T, d)
        return self.dropout(x) if self.training else x

    def encode(self, src_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """src_ids (B, S) -> memory (B, S, d), src_pad_mask (B, S) bool True = pad.
        Every row needs >= 1 real token (sources end with eos), or attention rows are all masked.
        Only real positions are computed (they never attend to padding): memory is 0 at padding."""
        memory, packing, src_pad_mask = self._encode_packed(src_ids)
        return packing.unpack(memory), src_pad_mask

    def decode(self, tgt_in_ids: torch.Tensor, memory: torch.Tensor, src_pad_mask: torch.Tensor,
               keep: torch.Tensor | None = None, memory_packing: Packing | None = None,
               keep_index: torch.Tensor | None = None, hidden_only: bool = False) -> torch.Tensor:
        """Teacher-forced decoder: tgt_in_ids (B, T) -> logits (B, T, V), or (M, V) for the M
        positions where `keep` (B, T) is True. Self-attention uses the causal mask only: with
        right padding every pad key sits after every real query, so it is never attended to
        from a position whose output is used. `keep` must be True on a prefix of each row (right
        padding, as `tgt_in_ids != pad_id`): the decoder then runs on those positions only.
        With `memory_packing`, memory is the (Ms, d) real source positions (see `Packing`);
        `keep_index`, if given, is `keep`'s flat True positions (computed on the host).
        `hidden_only`: the last layer's output (B, T, d) / (M, d), before the vocabulary projection
        (a fused projection + loss takes it: `model.loss.linear_label_smoothed_nll`)."""
        cross_mask = key_padding_to_attn_mask(src_pad_mask)  # (B, 1, 1, S)
        packing = None if keep is None else Packing(keep, keep_index)
        x = self._embed(self.tgt_embed, tgt_in_ids)  # (B, T, d)
        if packing is not None:
            x = packing.pack(x)  # (M, d)
        for layer in self.decoder_layers:
            x = layer(x, layer.cross_attn.project_kv(memory, memory_packing), cross_mask, is_causal=True,
                      packing=packing)
        return x if hidden_only else self.output_proj(x)  # (B, T, V) or (M, V)

    def _encode_packed(self, src_ids: torch.Tensor, src_index: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, Packing, torch.Tensor]:
        """`encode` at the real source positions only: memory (Ms, d), its Packing, src_pad_mask."""
        src_pad_mask = src_ids.eq(self.cfg.pad_id)  # (B, S)
        attn_mask = key_padding_to_attn_mask(src_pad_mask)  # (B, 1, 1, S)
        packing = Packing(~src_pad_mask, src_index)
        x = packing.pack(self._embed(self.src_embed, src_ids))  # (Ms, d)
        for layer in self.encoder_layers:
            x = layer(x, attn_mask, packing)
        return x, packing, src_pad_mask

    def forward(self, src_ids: torch.Tensor, tgt_in_ids: torch.Tensor, nonpad_only: bool = False,
                src_index: torch.Tensor | None = None, tgt_index: torch.Tensor | None = None,
                hidden_only: bool = False) -> torch.Tensor:
        """src_ids (B, S) = pieces + [eos]; tgt_in_ids (B, T) = [bos] + pieces -> logits (B, T, V).

        nonpad_only=True returns logits (M, V) only at the M non-pad decoder positions, row-major:
        pair them with `tgt_out_ids[tgt_out_ids != pad_id]` (the same positions). It skips the
        decoder's work on padding, the vocabulary projection and the loss included (the largest
        matmul of a training step). It is a forward argument, not a separate method, so
        DDP-wrapped calls keep working. The encoder always skips padding: its outputs there are
        never attended to. `src_index`/`tgt_index` (optional) are the flat non-pad positions of
        src_ids / tgt_in_ids, computed on the host (`pipeline.train.batching.collate`), so the
        step needs no device-to-host sync to find them. `hidden_only`: (M, d) or (B, T, d) before
        the vocabulary projection (`decode`)."""
        memory, memory_packing, src_pad_mask = self._encode_packed(src_ids, src_index)
        keep = tgt_in_ids.ne(self.cfg.pad_id) if nonpad_only else None
        return self.decode(tgt_in_ids, memory, src_pad_mask, keep=keep, memory_packing=memory_packing,
                           keep_index=tgt_index if nonpad_only else None, hidden_only=hidden_only)

    def init_decoder_state(self, memory: torch.Tensor, src_pad_mask: torch.Tensor, beam_size: int = 1,
                           max_len: int | None = None) -> DecoderState:
        """State for decoding B sentences with `beam_size` rows each, for up to `max_len` fed tokens
        (bos included; default and maximum `cfg.max_positions`)."""
        return DecoderState.start(self, memory, src_pad_mask, beam_size, max_len)

    def decode_step(self, prev_ids: torch.Tensor, state: DecoderState) -> torch.Tensor:
        """Feed one token per row at position `state.step`: prev_ids (N,) -> logits (N, V).
        Costs O(step) attention per row; advances `state.step`.

        At step 0 prev_ids may also be (B,), one row per sentence (beam search's first step,
        where a sentence's beams are all the same bos): the result is (B, V) and the cache of
        every beam of sentence b is that of its row."""
        t = state.step
        if t >= state.self_kv.shape[4]:
            raise ValueError(f"decoder state holds {state.self_kv.shape[4]} positions; step {t} is past it")
        N, k = state.self_kv.shape[2], state.beam_size
        shared = prev_ids.shape[0] != N
        if shared and (t != 0 or prev_ids.shape[0] * k != N):
            raise ValueError(f"prev_ids has {prev_ids.shape[0]} rows; the state has {N} (or {N // k} at step 0)")
        x = self._embed(self.tgt_embed, prev_ids.view(-1, 1), offset=t)  # (N, 1, d) or (B, 1, d)
        fast = state.layer_weights_t is not None and not self.training
        if fast:
            x = x[:, 0]  # (N, d)
        for i, layer in enumerate(self.decoder_layers):
            cache = state.self_kv[i][:, ::k] if shared else state.self_kv[i]  # beam 0 of each sentence
            if fast:
                x = _decoder_layer_step(state.layer_weights_t[i], x, state.cross_kv[i], state.cross_mask, cache, t)
            else:
                x = layer(x, state.cross_kv[i], state.cross_mask, cache=cache, step=t)
        if not fast:
            x = x[:, 0]  # (N, d)
        if shared and k > 1:  # beams 1..k-1 copy beam 0's slot 0
            kv0 = state.self_kv[:, :, :, :, :1]
            kv0.copy_(kv0[:, :, ::k].repeat_interleave(k, dim=2))
        state.step = t + 1
        return x @ state.output_weight_t  # (N, V), = self.output_proj(x)
