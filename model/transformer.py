"""Encoder-decoder Transformer (Vaswani et al., 2017, §3), top-down: positional encoding (§3.5),
attention (§3.2), feed-forward (§3.3), encoder and decoder layers (§3.1), the model (§3.4).
The rows after 2017 are options whose defaults are the paper's model (`ModelConfig`; docs/model.md):
rotary positions (`positional`), pre-norm (`norm_position`), RMSNorm (`norm`), SwiGLU (`ffn`).
Sequences: source = pieces + [eos] (no bos); decoder input = [bos] + pieces; decoder target =
pieces + [eos]; right-padded with pad_id. Shapes: B sentences, S source / T target length, M real
(non-pad) positions, d = d_model, h = n_heads, d_k / d_v the per-head widths (Table 3 A/B),
hs = max(d_k, d_v) (`model.compute`), V = vocab_size.

Beside it: `compute` (the heads, the real positions, the `Mask` an attention call gets: the layers
only pass it on; the CPU kernels, by the `cpu_kernels` option), `training` (§5: the optimizer, its
schedule, the label-smoothed loss), `incremental` (decoding one token at a time: the KV cache, the
beams), `attention_weights` (what attention sees, recorded by hooking `ScaledDotProductAttention`
from outside).
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import incremental
from .config import ModelConfig
from .compute import Dropout, Heads, Mask, NonPad, add_into, sdpa, source_mask, target_masks


def sinusoid_table(n_positions: int, d_model: int) -> torch.Tensor:
    """§3.5: PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d))."""
    pos = torch.arange(n_positions, dtype=torch.float64).unsqueeze(1)  # (P, 1)
    inv_freq = 10000.0 ** (-torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)  # (ceil(d/2),)
    table = torch.zeros(n_positions, d_model, dtype=torch.float64)
    table[:, 0::2] = torch.sin(pos * inv_freq)
    table[:, 1::2] = torch.cos(pos * inv_freq[: d_model // 2])
    return table.float()  # (P, d)


class Rotary(nn.Module):
    """Rotary positions (Su et al., 2021): each pair (x_2i, x_2i+1) of a head's query or key at
    position m is rotated by the angle m * theta_i, theta_i = 10000^(-2i/d_k), so that q_m . k_n
    depends on the offset m - n only. Pairs interleaved as in the paper (and as §3.5 interleaves
    the sinusoids); the zero columns a head is padded with (`model.compute`) are rotated by angle 0."""

    def __init__(self, d_k: int, hs: int, n_positions: int):
        super().__init__()
        inv_freq = 10000.0 ** (-torch.arange(0, d_k, 2, dtype=torch.float64) / d_k)  # (d_k/2,)
        angles = F.pad(torch.arange(n_positions, dtype=torch.float64)[:, None] * inv_freq, (0, (hs - d_k) // 2))
        # Not persistent: a function of the config, as the sinusoid table.
        self.register_buffer("cos", angles.cos().float(), persistent=False)  # (P, hs/2)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, x: torch.Tensor, start: int = 0) -> torch.Tensor:
        """x (..., T, hs) at positions start..start+T-1 -> rotated, the same shape and dtype."""
        T = x.shape[-2]
        cos, sin = self.cos[start : start + T].to(x.dtype), self.sin[start : start + T].to(x.dtype)  # (T, hs/2)
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


def _init_linear(linear: nn.Linear, blocks: int | list[int] = 1) -> None:
    """xavier_uniform per stacked block of output rows (``blocks`` equal ones, or these row
    counts), so a fused Q/K/V projection is initialised like separate ones; bias 0."""
    if isinstance(blocks, int):
        blocks = [linear.weight.shape[0] // blocks] * blocks
    for block in linear.weight.split(blocks, dim=0):
        nn.init.xavier_uniform_(block)
    nn.init.zeros_(linear.bias)


class ScaledDotProductAttention(nn.Module):
    """Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V (§3.2.1), all heads at once (SDPA), each
    query over the keys `mask` allows (§3.2.3). Nothing to learn; a module of its own so that what
    it attends to can be read from outside (`attention_weights.record_attention` hooks it). Called
    with every argument positional."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask, scale: float | None
                ) -> torch.Tensor:
        return sdpa(q, k, v, attn_mask=mask.keys, is_causal=mask.causal, scale=scale)


def _add_dropped(x: torch.Tensor, y: torch.Tensor, dropout: nn.Dropout) -> torch.Tensor:
    """x + dropout(y) (§5.4), in y's memory (a sublayer's fresh output; autograd needs neither value)."""
    return add_into(dropout(y) if dropout.training and dropout.p > 0 else y, x)


def _residual(x: torch.Tensor, sublayer: Callable[[torch.Tensor], torch.Tensor], norm: nn.Module,
              dropout: nn.Dropout, pre_norm: bool) -> torch.Tensor:
    """One sublayer with its residual connection (§3.1, §5.4). Post-norm (the paper):
    Norm(x + Dropout(Sublayer(x))). Pre-norm (Xiong et al., 2020): x + Dropout(Sublayer(Norm(x))):
    the residual path is never normalised, so gradients reach early layers unscaled and training
    needs less warmup; the stack then ends with a norm of its own (`Transformer.encoder_norm`)."""
    if pre_norm:
        return _add_dropped(x, sublayer(norm(x)), dropout)
    return norm(_add_dropped(x, sublayer(x), dropout))


def make_norm(cfg: ModelConfig) -> nn.Module:
    """LayerNorm (§3.1), or RMSNorm for cfg.norm = "rmsnorm" (Zhang & Sennrich, 2019):
    g * x / sqrt(mean(x^2) + eps), no mean subtracted and no bias, for a cheaper norm that trains
    as well. Both with eps 1e-5, our LayerNorm's (see `EncoderLayer`): CTranslate2 takes one eps for all."""
    if cfg.norm == "rmsnorm":
        return nn.RMSNorm(cfg.d_model, eps=1e-5)
    return nn.LayerNorm(cfg.d_model)


class SelfAttention(nn.Module):
    """Multi-head self-attention (§3.2.2); Q, K, V come from one fused (d, 3d) projection.

    Deviation: the Q/K/V/O projections have biases (the paper writes bare matrices W^Q...,
    tensor2tensor has none) because fairseq and torch.nn.MultiheadAttention, our test reference,
    have them; it adds 4 * d_model parameters per attention block.
    """

    def __init__(self, d_model: int, n_heads: int, d_k: int | None = None, d_v: int | None = None,
                 rotary_positions: int = 0):
        super().__init__()
        self.n_heads = n_heads
        self.heads = Heads(d_model, n_heads, d_k, d_v)
        dk, dv = self.heads.d_k, self.heads.d_v
        self.qkv_proj = nn.Linear(d_model, n_heads * (2 * dk + dv))  # rows: [W_Q; W_K; W_V], all heads
        self.out_proj = nn.Linear(n_heads * dv, d_model)  # W_O
        self.attention = ScaledDotProductAttention()
        # Rotary positions (ModelConfig.positional = "rotary") rotate q and k at up to this many positions.
        self.rotary = Rotary(dk, self.heads.hs, rotary_positions) if rotary_positions else None

    def reset_parameters(self) -> None:
        h, dk, dv = self.n_heads, self.heads.d_k, self.heads.d_v
        _init_linear(self.qkv_proj, [h * dk, h * dk, h * dv])
        _init_linear(self.out_proj)

    def forward(self, x: torch.Tensor, mask: Mask) -> torch.Tensor:
        """x (B, T, d) -> (B, T, d), each position attending over the positions `mask` allows (the
        rows of x and of the result are the batch's real positions when `mask.at` says so)."""
        hd = self.heads
        q, k, v = mask.split_heads(self.qkv_proj(x), hd, (hd.d_k, hd.d_k, hd.d_v))  # each (B, h, T, hs)
        if self.rotary is not None:  # Su et al. (2021): q and k rotated by their positions
            q, k = self.rotary(q), self.rotary(k)
        return self.out_proj(mask.merge_heads(self.attention(q, k, v, mask, hd.scale), hd))  # W_O


class CrossAttention(nn.Module):
    """Encoder-decoder attention (§3.2.3): queries from the decoder, keys/values from memory.
    No rotary positions here: a target and a source position index different sequences, so their
    offset means nothing (Su et al. rotate in self-attention only, as CTranslate2's spec does);
    both sides' order reaches it through their self-attention layers."""

    def __init__(self, d_model: int, n_heads: int, d_k: int | None = None, d_v: int | None = None):
        super().__init__()
        self.n_heads = n_heads
        self.heads = Heads(d_model, n_heads, d_k, d_v)
        dk, dv = self.heads.d_k, self.heads.d_v
        self.q_proj = nn.Linear(d_model, n_heads * dk)
        self.kv_proj = nn.Linear(d_model, n_heads * (dk + dv))  # rows: [W_K; W_V]
        self.out_proj = nn.Linear(n_heads * dv, d_model)
        self.attention = ScaledDotProductAttention()

    def reset_parameters(self) -> None:
        h, dk, dv = self.n_heads, self.heads.d_k, self.heads.d_v
        _init_linear(self.q_proj)
        _init_linear(self.kv_proj, [h * dk, h * dv])
        _init_linear(self.out_proj)

    def project_kv(self, memory: torch.Tensor, layout: Mask | None = None) -> torch.Tensor:
        """memory (B, S, d), or its real positions as the encoder's `layout.at` has them -> K and V
        (2, B, h, S, hs)."""
        return (layout or Mask()).split_heads(self.kv_proj(memory), self.heads, (self.heads.d_k, self.heads.d_v))

    def forward(self, x: torch.Tensor, kv: torch.Tensor, mask: Mask) -> torch.Tensor:
        """x (B, T, d); kv (2, B, h, S, hs) (`project_kv`) -> (B, T, d), each query over the source
        positions `mask.keys` allows (its rows as `SelfAttention`'s)."""
        hd = self.heads
        q = mask.split_queries(self.q_proj(x), hd)  # (B, h, T, hs)
        return self.out_proj(mask.merge_heads(self.attention(q, kv[0], kv[1], mask, hd.scale), hd))


class FeedForward(nn.Module):
    """FFN(x) = max(0, x W1 + b1) W2 + b2 (§3.3). Gated, ModelConfig.ffn = "swiglu" (Shazeer, 2020):
    FFN(x) = (silu(x W1 + b1) * (x W3 + b3)) W2 + b2, d_ff the width of W1 and W3.

    Deviation (from Shazeer, who drops the biases): W3 has a bias as W1 and W2 do (§3.3), because
    the option then swaps the activation only."""

    def __init__(self, d_model: int, d_ff: int, gated: bool = False):
        super().__init__()
        self.w1 = nn.Linear(d_model, d_ff)
        self.w2 = nn.Linear(d_ff, d_model)
        self.w3 = nn.Linear(d_model, d_ff) if gated else None  # SwiGLU's linear (ungated) half

    def reset_parameters(self) -> None:
        for w in (self.w1, self.w2, self.w3):
            if w is not None:
                _init_linear(w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w3 is not None:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.w2(F.relu(self.w1(x), inplace=True))


def _self_attention(cfg: ModelConfig) -> SelfAttention:
    return SelfAttention(cfg.d_model, cfg.n_heads, cfg.d_k, cfg.d_v,
                         rotary_positions=cfg.max_positions if cfg.positional == "rotary" else 0)


class EncoderLayer(nn.Module):
    """Self-attention and FFN, each a post-norm sublayer (§3.1) x = LayerNorm(x + Dropout(Sublayer(x)))
    (§5.4), or a pre-norm one (`_residual`).

    Deviation: LayerNorm eps is PyTorch's 1e-5 (tensor2tensor: 1e-6; the paper gives none)
    because it matches the torch.nn reference layers the tests compare against.
    """

    def __init__(self, cfg: ModelConfig, cpu_kernels: bool = True):
        super().__init__()
        self.self_attn = _self_attention(cfg)
        self.norm1 = make_norm(cfg)
        self.ffn = FeedForward(cfg.d_model, cfg.d_ff, gated=cfg.ffn == "swiglu")
        self.norm2 = make_norm(cfg)
        self.dropout = Dropout(cfg.dropout, cpu_kernels)
        self.pre_norm = cfg.norm_position == "pre"

    def forward(self, x: torch.Tensor, mask: Mask) -> torch.Tensor:  # (B, S, d) -> (B, S, d)
        x = _residual(x, lambda y: self.self_attn(y, mask), self.norm1, self.dropout, self.pre_norm)
        return _residual(x, self.ffn, self.norm2, self.dropout, self.pre_norm)


class DecoderLayer(nn.Module):
    """Masked self-attention, cross-attention and FFN, each a post-norm (§3.1) or pre-norm sublayer."""

    def __init__(self, cfg: ModelConfig, cpu_kernels: bool = True):
        super().__init__()
        self.self_attn = _self_attention(cfg)
        self.norm1 = make_norm(cfg)
        self.cross_attn = CrossAttention(cfg.d_model, cfg.n_heads, cfg.d_k, cfg.d_v)
        self.norm2 = make_norm(cfg)
        self.ffn = FeedForward(cfg.d_model, cfg.d_ff, gated=cfg.ffn == "swiglu")
        self.norm3 = make_norm(cfg)
        self.dropout = Dropout(cfg.dropout, cpu_kernels)
        self.pre_norm = cfg.norm_position == "pre"

    def forward(self, x: torch.Tensor, cross_kv: torch.Tensor, self_mask: Mask, cross_mask: Mask
                ) -> torch.Tensor:  # (B, T, d) -> (B, T, d); cross_kv: `CrossAttention.project_kv`'s
        x = _residual(x, lambda y: self.self_attn(y, self_mask), self.norm1, self.dropout, self.pre_norm)
        x = _residual(x, lambda y: self.cross_attn(y, cross_kv, cross_mask), self.norm2, self.dropout,
                      self.pre_norm)
        return _residual(x, self.ffn, self.norm3, self.dropout, self.pre_norm)


class Transformer(nn.Module):
    """Transformer (§3): src (B, S) + decoder input (B, T) -> decoder output (B, T, d), whose
    `logits` (B, T, V) predict the next token. `cpu_kernels`: `compute.Dropout`'s cheaper masks on
    CPU tensors in eager training (False: PyTorch's, e.g. for an eager model compared with a compiled one)."""

    def __init__(self, cfg: ModelConfig, cpu_kernels: bool = True):
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
        # Table 3 row E: learned positional embeddings (Gehring et al., §3.5); the sinusoids then unused.
        # Rotary positions (Su et al., 2021) add nothing here: self-attention rotates q and k instead.
        self.pos_embed = nn.Embedding(cfg.max_positions, d) if cfg.positional == "learned" else None
        self.dropout = Dropout(cfg.dropout, cpu_kernels)  # §5.4: on the sums of embeddings and positions
        self.encoder_layers = nn.ModuleList(EncoderLayer(cfg, cpu_kernels) for _ in range(cfg.n_encoder_layers))
        self.decoder_layers = nn.ModuleList(DecoderLayer(cfg, cpu_kernels) for _ in range(cfg.n_decoder_layers))
        # Pre-norm sublayers leave the residual stream unnormalised: a norm closes each stack (Xiong
        # et al., 2020; fairseq's normalize_before, CTranslate2's pre_norm spec).
        pre_norm = cfg.norm_position == "pre"
        self.encoder_norm = make_norm(cfg) if pre_norm else None
        self.decoder_norm = make_norm(cfg) if pre_norm else None
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The paper gives no initialisation. Linear weights: xavier_uniform (fairseq, the Annotated
        Transformer, torch.nn.Transformer; tensor2tensor: the close uniform_unit_scaling), per
        Q/K/V block of the fused projections so each gets the fan of a (d, d) matrix; biases 0.
        Embeddings (and an untied output projection): normal(0, d_model^-0.5) as fairseq does, so
        that embedding * sqrt(d_model) has unit scale; the pad row starts at 0 (fairseq)."""
        for module in self.modules():
            if isinstance(module, (SelfAttention, CrossAttention, FeedForward, nn.LayerNorm, nn.RMSNorm)):
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

    def position_table(self) -> torch.Tensor:
        """(max_positions, d): what `embed` adds at each position: the sinusoids (§3.5), the
        learned table (Table 3 row E) when ModelConfig.positional = "learned", zeros for "rotary"."""
        if self.cfg.positional == "rotary":
            return torch.zeros_like(self.pos_table)
        return self.pos_table if self.pos_embed is None else self.pos_embed.weight

    def embed(self, embedding: nn.Embedding, ids: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """§3.4, §3.5: ids (B, T) at positions offset.. -> embedding * sqrt(d) + PE, dropped out (B, T, d)."""
        T = ids.shape[1]
        if offset + T > self.cfg.max_positions:
            raise ValueError(f"position {offset + T - 1} >= ModelConfig.max_positions={self.cfg.max_positions}")
        x = embedding(ids).mul_(self.emb_scale)  # (B, T, d)
        if self.cfg.positional != "rotary":  # rotary positions act inside self-attention instead
            x.add_(self.position_table()[offset : offset + T])
        return self.dropout(x) if self.training else x

    def _encode(self, src_ids: torch.Tensor, src_index: torch.Tensor | None = None) -> tuple[torch.Tensor, Mask]:
        """The encoder at real source positions only: memory (Ms, d) and its self-attention's mask."""
        mask = source_mask(src_ids, self.cfg.pad_id, src_index)
        x = mask.pack(self.embed(self.src_embed, src_ids))  # (Ms, d)
        for layer in self.encoder_layers:
            x = layer(x, mask)
        if self.encoder_norm is not None:  # pre-norm's final norm
            x = self.encoder_norm(x)
        return x, mask

    def encode(self, src_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """src_ids (B, S) -> memory (B, S, d), 0 at padding; src_pad_mask (B, S) bool True = pad.
        Every row needs >= 1 real token (sources end with eos), or attention rows are all masked."""
        memory, mask = self._encode(src_ids)
        return mask.unpack(memory), src_ids.eq(self.cfg.pad_id)

    def forward(self, src_ids: torch.Tensor, tgt_in_ids: torch.Tensor, nonpad: NonPad | None = None
                ) -> torch.Tensor:
        """src_ids (B, S) = pieces + [eos]; tgt_in_ids (B, T) = [bos] + pieces -> the last decoder
        layer's output (B, T, d); `logits` projects it onto the vocabulary.

        With `nonpad`, only the M non-pad decoder positions are computed, row-major: (M, d), to pair
        with `tgt_out_ids[tgt_out_ids != pad_id]`: no work on padding, nor the caller's projection
        and loss there (a step's largest matmul). The encoder always skips padding. The causal mask
        suffices: right padding puts every pad key after every real query."""
        memory, source = self._encode(src_ids, None if nonpad is None else nonpad.src_index)
        self_mask, cross_mask = target_masks(tgt_in_ids, self.cfg.pad_id, source, nonpad)
        x = self_mask.pack(self.embed(self.tgt_embed, tgt_in_ids))  # (B, T, d), or (M, d) with nonpad
        for layer in self.decoder_layers:
            x = layer(x, layer.cross_attn.project_kv(memory, source), self_mask, cross_mask)
        if self.decoder_norm is not None:  # pre-norm's final norm
            x = self.decoder_norm(x)
        return x  # (B, T, d), or (M, d) at the real target positions with nonpad

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """§3.4: decoder output (..., d) -> next-token logits (..., V), before the softmax (a fused
        projection + loss takes `output_proj.weight` instead: `linear_label_smoothed_nll`)."""
        return self.output_proj(hidden)

    def init_decoder_state(self, memory: torch.Tensor, src_pad_mask: torch.Tensor, beam_size: int = 1,
                           max_len: int | None = None) -> incremental.DecoderState:
        """Caches for B sentences x `beam_size` rows, up to `max_len` fed tokens (`incremental.start`)."""
        return incremental.start(self, memory, src_pad_mask, beam_size, max_len)

    def decode_step(self, prev_ids: torch.Tensor, state: incremental.DecoderState) -> torch.Tensor:
        """One token per row at position `state.step`: prev_ids (N,) -> logits (N, V) (`incremental`)."""
        return incremental.decode_step(self, prev_ids, state)
