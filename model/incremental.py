"""Incremental decoding: the Transformer's decoder fed one token per row and step, with caches.

A search (model/search.py) encodes once, then calls `decode_step` once per output position:
each step attends over the cached keys and values of the earlier positions (O(step) per row)
instead of running the decoder over the whole prefix again. Rows are sentence-major: row
r = b * beam_size + j is beam j of sentence b.

A step runs `decoder_layer_step`: `DecoderLayer.forward` for one new position per row, fused by
hand on transposed weight copies made once per search (`LayerWeights`), with the self-attention's
keys and values cached here and a sentence's beams folded into the cross-attention's query axis
(the layers themselves know neither). Decoding is inference: the model must be in eval mode (no
dropout). The step is checked against the teacher-forced forward at every value of every
`ModelConfig` field (tests/unit/model/test_fused_step.py, which fails on a field it does not know):
a variant added to `DecoderLayer` and not here fails there, before a model trains one way and
decodes another.
`Transformer.init_decoder_state` / `decode_step` call `start` / `decode_step` here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F

from .compute import Heads, Mask, Positions, add_into, key_padding_to_attn_mask


Linear = tuple[torch.Tensor, torch.Tensor]  # (W.T contiguous (d_in, d_out), bias)


@dataclass(frozen=True, kw_only=True)
class LayerWeights:
    """What `decoder_layer_step` reads of a `DecoderLayer`: each Linear as (W.T contiguous
    (d_in, d_out), bias), since for the few rows of a step addmm(b, x, W.T) beats F.linear's
    x @ W.T on CPU; each norm as (gain, bias), bias None for RMSNorm. Made once per search, not
    per step. The options after the paper (`ModelConfig`) are the last four fields."""

    heads: Heads  # h, d_k, d_v, the padded head width hs = max(d_k, d_v), SDPA's scale
    eps: float  # the norms' epsilon
    qkv: Linear  # self-attention [W_Q; W_K; W_V]^T (d, h * (2 d_k + d_v)), bias
    self_out: Linear  # self-attention W_O^T (d, d), bias
    cross_q: Linear  # cross-attention W_Q^T (d, h * d_k), bias
    cross_out: Linear  # cross-attention W_O^T (d, d), bias
    ffn1: Linear  # W_1^T (d, d_ff), b_1
    ffn2: Linear  # W_2^T (d_ff, d), b_2
    norm1: tuple[torch.Tensor, torch.Tensor | None]  # gain, bias
    norm2: tuple[torch.Tensor, torch.Tensor | None]
    norm3: tuple[torch.Tensor, torch.Tensor | None]
    pre_norm: bool = False  # x + Sublayer(Norm(x)) instead of Norm(x + Sublayer(x))
    rms_norm: bool = False  # RMSNorm instead of LayerNorm
    ffn3: Linear | None = None  # SwiGLU's W_3^T (d, d_ff), b_3
    rotary: nn.Module | None = None  # the self-attention's `Rotary`

    @classmethod
    def of(cls, layer: nn.Module) -> "LayerWeights":
        """The weights of `layer` (a `DecoderLayer`)."""
        sa, ca, ffn = layer.self_attn, layer.cross_attn, layer.ffn

        def linear(m: nn.Linear) -> Linear:
            return m.weight.t().contiguous(), m.bias

        def norm(m: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
            return m.weight, getattr(m, "bias", None)

        return cls(heads=sa.heads, eps=layer.norm1.eps, qkv=linear(sa.qkv_proj),
                   self_out=linear(sa.out_proj), cross_q=linear(ca.q_proj), cross_out=linear(ca.out_proj),
                   ffn1=linear(ffn.w1), ffn2=linear(ffn.w2),
                   norm1=norm(layer.norm1), norm2=norm(layer.norm2), norm3=norm(layer.norm3), pre_norm=layer.pre_norm,
                   rms_norm=isinstance(layer.norm1, nn.RMSNorm), ffn3=None if ffn.w3 is None else linear(ffn.w3),
                   rotary=sa.rotary)


def decoder_layer_step(w: LayerWeights, x: torch.Tensor, cross_kv: torch.Tensor, cross_mask: torch.Tensor,
                       cache: torch.Tensor, step: int) -> torch.Tensor:
    """`DecoderLayer.forward` for one new token per row in eval mode (no dropout), on x (N, d),
    with the layer's `LayerWeights`; writes this step's K/V at `step` of cache (2, N, h, L, hs).
    Each sublayer as `transformer._residual`: Norm(x + Sublayer(x)), or x + Sublayer(Norm(x)) pre-norm."""
    if w.pre_norm:  # Xiong et al. (2020)
        x = add_into(_self_attention(w, _norm(w, w.norm1, x), cache, step), x)
        x = add_into(_cross_attention(w, _norm(w, w.norm2, x), cross_kv, cross_mask), x)
        return add_into(_ffn(w, _norm(w, w.norm3, x)), x)
    x = _norm(w, w.norm1, add_into(_self_attention(w, x, cache, step), x))
    x = _norm(w, w.norm2, add_into(_cross_attention(w, x, cross_kv, cross_mask), x))
    return _norm(w, w.norm3, add_into(_ffn(w, x), x))


def _self_attention(w: LayerWeights, x: torch.Tensor, cache: torch.Tensor, step: int) -> torch.Tensor:
    hd = w.heads
    N, h, hs = x.shape[0], hd.n_heads, hd.hs
    qkv = torch.addmm(w.qkv[1], x, w.qkv[0])  # (N, h * (2 d_k + d_v))
    if hd.uniform:  # one view, no copy (a step's rows are few: Python's overhead counts)
        qkv = qkv.view(N, 3, h, hs)
        q, kv = qkv[:, 0, :, None], qkv[:, 1:].transpose(0, 1)  # (N, h, 1, hs), (2, N, h, hs)
    else:  # Table 3 rows A/B: each head's q, k, v zero-padded to hs
        qkv = hd.split(qkv[:, None], (hd.d_k, hd.d_k, hd.d_v))  # (3, N, h, 1, hs)
        q, kv = qkv[0], qkv[1:, :, :, 0]
    if w.rotary is not None:  # Su et al. (2021): the new query and key rotated by their position
        q, kv = w.rotary(q, step), torch.stack((w.rotary(kv[0, :, :, None], step)[:, :, 0], kv[1]))
    cache[:, :, :, step] = kv  # this position's K and V, one copy
    y = F.scaled_dot_product_attention(q, cache[0, :, :, : step + 1], cache[1, :, :, : step + 1],
                                       scale=hd.scale)  # (N, h, 1, hs)
    return torch.addmm(w.self_out[1], hd.merge(y).view(N, -1), w.self_out[0])


def _cross_attention(w: LayerWeights, x: torch.Tensor, cross_kv: torch.Tensor, cross_mask: torch.Tensor
                     ) -> torch.Tensor:
    """The beams of a sentence share its memory: they are its queries (B, h, beam, hs), so the
    cross K/V are stored once per sentence, never copied beam times."""
    hd = w.heads
    N, B = x.shape[0], cross_kv.shape[1]
    q = hd.split_queries(torch.addmm(w.cross_q[1], x, w.cross_q[0]).view(B, N // B, -1))  # (B, h, beam, hs)
    y = F.scaled_dot_product_attention(q, cross_kv[0], cross_kv[1], attn_mask=cross_mask, scale=hd.scale)
    return torch.addmm(w.cross_out[1], hd.merge(y).reshape(N, -1), w.cross_out[0])  # merge: (B, beam, h * d_v)


def _ffn(w: LayerWeights, x: torch.Tensor) -> torch.Tensor:
    hidden = torch.addmm(w.ffn1[1], x, w.ffn1[0])
    if w.ffn3 is None:
        return torch.addmm(w.ffn2[1], hidden.relu_(), w.ffn2[0])
    return torch.addmm(w.ffn2[1], F.silu(hidden) * torch.addmm(w.ffn3[1], x, w.ffn3[0]), w.ffn2[0])  # SwiGLU


def _norm(w: LayerWeights, norm: tuple[torch.Tensor, torch.Tensor | None], x: torch.Tensor) -> torch.Tensor:
    if w.rms_norm:
        return F.rms_norm(x, (x.shape[-1],), norm[0], w.eps)
    return torch.layer_norm(x, (x.shape[-1],), *norm, w.eps)


def _gather_cache(self_kv: torch.Tensor, indices: torch.Tensor, t: int, out: torch.Tensor) -> None:
    """out's first t slots = self_kv's rows `indices` (dim 2) there."""
    if t > 0 and self_kv.requires_grad:  # out= does not differentiate: gather and copy
        out[:, :, :, :, :t] = self_kv[:, :, :, :, :t].index_select(2, indices)
    elif t > 0:
        torch.index_select(self_kv[:, :, :, :, :t], 2, indices, out=out[:, :, :, :, :t])


@dataclass(kw_only=True)
class DecoderState:
    """Caches for incremental decoding (`decode_step`), updated in place.

    The self-attention cache is preallocated for `max_len` fed tokens, so a step writes one slot
    instead of concatenating; the cross-attention K/V are computed once and stored once per
    sentence. It has both abilities `model.search.SearchState` declares: a shared first step
    (`first_step_per_sentence`) and dropping finished sentences (`drops_sentences`).
    """

    self_kv: torch.Tensor  # (n_layers, 2, N, h, max_len, hs); slots < step are valid
    cross_kv: torch.Tensor  # (n_layers, 2, B, h, S, hs), shared by a sentence's beams
    cross_mask: torch.Tensor  # (B, 1, 1, S) bool, True = real source token
    output_weight_t: torch.Tensor  # (d, V) contiguous copy of output_proj.weight.T: for the few
    # rows of a decoding step, x @ W_t runs faster on CPU (MKL) than F.linear's x @ W.T
    beam_size: int
    step: int = 0  # tokens fed so far = position of the next token
    spare_kv: torch.Tensor | None = None  # reorder's target buffer, swapped with self_kv
    layer_weights: list[LayerWeights]  # what each decoder layer's step reads
    first_step_per_sentence: ClassVar[bool] = True  # decode_step takes one row per sentence at step 0
    drops_sentences: ClassVar[bool] = True  # reorder takes `sentences`

    def reorder(self, indices: torch.Tensor, sentences: torch.Tensor | None = None) -> None:
        """Row r takes the history of row indices[r] (beam search). indices (N,) long must keep
        every row within its own sentence, i.e. indices[r] // beam_size == r // beam_size.
        Gathers into a second buffer of self_kv's size (allocated on first use) and swaps the
        two: one pass over the cache instead of a gather and a copy back.

        With ``sentences`` (B',) long, increasing: only those sentences stay (beam search drops the
        finished ones); indices (B' * beam_size,) then name rows of those sentences' blocks, in
        their order, and every cache shrinks to B' sentences (new buffers; the spare one is
        allocated again at the new size)."""
        t = self.step
        if sentences is not None:
            kv = self.self_kv
            self.self_kv = kv.new_empty(*kv.shape[:2], len(indices), *kv.shape[3:])
            _gather_cache(kv, indices, t, self.self_kv)
            self.cross_kv = self.cross_kv.index_select(2, sentences)
            self.cross_mask = self.cross_mask.index_select(0, sentences)
            self.spare_kv = None
            return
        if t > 0 and self.self_kv.requires_grad:  # out= does not differentiate: gather and copy back
            self.self_kv[:, :, :, :, :t] = self.self_kv[:, :, :, :, :t].index_select(2, indices)
        elif t > 0:
            if self.spare_kv is None:
                self.spare_kv = torch.empty_like(self.self_kv)
            _gather_cache(self.self_kv, indices, t, self.spare_kv)
            self.self_kv, self.spare_kv = self.spare_kv, self.self_kv


def start(model: Any, memory: torch.Tensor, src_pad_mask: torch.Tensor, beam_size: int = 1,
          max_len: int | None = None) -> DecoderState:
    """The caches of `model`'s (a `Transformer`'s) decoder layers for memory (B, S, d), `beam_size`
    rows per sentence, up to `max_len` fed tokens (bos included; default and maximum
    `cfg.max_positions`). The model must be in eval mode: decoding has no dropout."""
    cfg, layers = model.cfg, model.decoder_layers
    if model.training:
        raise ValueError("incremental decoding runs the model in eval mode (no dropout): call model.eval() first")
    max_len = cfg.max_positions if max_len is None else max_len
    if not 0 < max_len <= cfg.max_positions:
        raise ValueError(f"max_len={max_len} must be in [1, max_positions={cfg.max_positions}]")
    B, S, d = memory.shape
    h, heads = cfg.n_heads, layers[0].self_attn.heads
    source = Mask(at=Positions(~src_pad_mask))  # K/V only at real source positions (0 at padding, masked)
    memory = source.pack(memory)  # (Ms, d)
    cross_kv = torch.stack([layer.cross_attn.project_kv(memory, source) for layer in layers])
    self_kv = cross_kv.new_empty(len(layers), 2, B * beam_size, h, max_len, heads.hs)
    output_weight_t = model.output_proj.weight.t().contiguous()
    return DecoderState(self_kv=self_kv, cross_kv=cross_kv, cross_mask=key_padding_to_attn_mask(src_pad_mask),
                        output_weight_t=output_weight_t, beam_size=beam_size,
                        layer_weights=[LayerWeights.of(layer) for layer in layers])


def decode_step(model: Any, prev_ids: torch.Tensor, state: DecoderState) -> torch.Tensor:
    """Feed `model` (a `Transformer`) one token per row at position `state.step`: prev_ids (N,) ->
    logits (N, V). Costs O(step) attention per row; advances `state.step`.

    At step 0 prev_ids may also be (B,), one row per sentence (beam search's first step, where a
    sentence's beams are all the same bos): the result is (B, V) and the cache of every beam of
    sentence b is that of its row."""
    t = state.step
    if t >= state.self_kv.shape[4]:
        raise ValueError(f"decoder state holds {state.self_kv.shape[4]} positions; step {t} is past it")
    N, k = state.self_kv.shape[2], state.beam_size
    shared = prev_ids.shape[0] != N
    if shared and (t != 0 or prev_ids.shape[0] * k != N):
        raise ValueError(f"prev_ids has {prev_ids.shape[0]} rows; the state has {N} (or {N // k} at step 0)")
    x = model.embed(model.tgt_embed, prev_ids.view(-1, 1), offset=t)[:, 0]  # (N, d) or (B, d)
    for i, weights in enumerate(state.layer_weights):
        cache = state.self_kv[i][:, ::k] if shared else state.self_kv[i]  # beam 0 of each sentence
        x = decoder_layer_step(weights, x, state.cross_kv[i], state.cross_mask, cache, t)
    if model.decoder_norm is not None:  # pre-norm's final norm
        x = model.decoder_norm(x)
    if shared and k > 1:  # beams 1..k-1 copy beam 0's slot 0
        kv0 = state.self_kv[:, :, :, :, :1]
        kv0.copy_(kv0[:, :, ::k].repeat_interleave(k, dim=2))
    state.step = t + 1
    return x @ state.output_weight_t  # (N, V), = model.logits(x) up to rounding
