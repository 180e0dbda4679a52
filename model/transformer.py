"""Encoder-decoder Transformer (Vaswani et al., 2017, §3) with incremental decoding.

Sequence conventions (the data pipeline relies on them): source = pieces + [eos] (no bos);
decoder input = [bos] + pieces; decoder target = pieces + [eos]; right-padded with pad_id.

Shapes: B sentences, N = B * beam rows while decoding, S source length, T target length,
d = d_model, h = n_heads, hs = d / h, V = vocab_size, L = decoder cache length.
Padding is on the right; `pad_id` marks it. Boolean attention masks follow
`F.scaled_dot_product_attention`: True = this key may be attended to.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import ModelConfig


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
    return x.view(B, T, n_heads, d // n_heads).transpose(1, 2)  # (B, h, T, hs)


def _merge_heads(x: torch.Tensor) -> torch.Tensor:
    B, h, T, hs = x.shape
    return x.transpose(1, 2).reshape(B, T, h * hs)  # (B, T, d)


def _init_linear(linear: nn.Linear, n_blocks: int = 1) -> None:
    """xavier_uniform per stacked (d_out/n_blocks, d_in) block, so a fused Q/K/V projection is
    initialised like separate ones; bias 0."""
    for block in linear.weight.chunk(n_blocks, dim=0):
        nn.init.xavier_uniform_(block)
    nn.init.zeros_(linear.bias)


def key_padding_to_attn_mask(pad_mask: torch.Tensor) -> torch.Tensor:
    """(B, S) bool True = pad  ->  (B, 1, 1, S) bool True = may attend (SDPA convention)."""
    return ~pad_mask[:, None, None, :]


class SelfAttention(nn.Module):
    """Multi-head self-attention (§3.2.2); Q, K, V come from one fused (d, 3d) projection.

    Deviation: the Q/K/V/O projections have biases (the paper writes bare matrices W^Q...,
    tensor2tensor has none) because fairseq and torch.nn.MultiheadAttention, our test reference,
    have them; it adds 4 * d_model parameters per attention block.
    """

    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.qkv_proj = nn.Linear(d_model, 3 * d_model)  # rows: [W_Q; W_K; W_V], all heads
        self.out_proj = nn.Linear(d_model, d_model)  # W_O

    def reset_parameters(self) -> None:
        _init_linear(self.qkv_proj, 3)
        _init_linear(self.out_proj)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False,
                cache: torch.Tensor | None = None, step: int = 0) -> torch.Tensor:
        """x (B, T, d) -> (B, T, d). With `cache` (2, B, h, L, hs), T must be 1: the new K/V are
        written at position `step` and the query attends to positions 0..step (no mask needed)."""
        B, T, d = x.shape
        qkv = self.qkv_proj(x).view(B, T, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv  # each (B, h, T, hs)
        if cache is not None:
            cache[:, :, :, step : step + 1] = qkv[1:]  # (2, B, h, 1, hs)
            k, v = cache[0, :, :, : step + 1], cache[1, :, :, : step + 1]  # (B, h, step+1, hs)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal)
        return self.out_proj(_merge_heads(y))


class CrossAttention(nn.Module):
    """Encoder-decoder attention (§3.2.3): queries from the decoder, keys/values from memory."""

    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.q_proj = nn.Linear(d_model, d_model)
        self.kv_proj = nn.Linear(d_model, 2 * d_model)  # rows: [W_K; W_V]
        self.out_proj = nn.Linear(d_model, d_model)

    def reset_parameters(self) -> None:
        _init_linear(self.q_proj)
        _init_linear(self.kv_proj, 2)
        _init_linear(self.out_proj)

    def project_kv(self, memory: torch.Tensor) -> torch.Tensor:
        B, S, d = memory.shape
        kv = self.kv_proj(memory).view(B, S, 2, self.n_heads, d // self.n_heads)
        return kv.permute(2, 0, 3, 1, 4)  # (2, B, h, S, hs)

    def forward(self, x: torch.Tensor, kv: torch.Tensor, attn_mask: torch.Tensor) -> torch.Tensor:
        """x (N, T, d) with N = B * beam, sentence-major; kv (2, B, h, S, hs); attn_mask (B, 1, 1, S)."""
        N, T, d = x.shape
        B = kv.shape[1]
        # The beams of one sentence share its memory, so they are folded into the query axis
        # instead of copying K/V beam times: (N, T, d) -> (B, beam * T, d).
        q = _split_heads(self.q_proj(x.reshape(B, (N // B) * T, d)), self.n_heads)  # (B, h, beam*T, hs)
        y = F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=attn_mask)
        return self.out_proj(_merge_heads(y)).view(N, T, d)


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
        return self.w2(F.relu(self.w1(x)))


class EncoderLayer(nn.Module):
    """Post-norm block (§3.1): x = LayerNorm(x + Dropout(Sublayer(x))) (§5.4).

    Deviation: LayerNorm eps is PyTorch's 1e-5 (tensor2tensor: 1e-6; the paper gives none)
    because it matches the torch.nn reference layers the tests compare against.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = SelfAttention(cfg.d_model, cfg.n_heads)
        self.norm1 = nn.LayerNorm(cfg.d_model)
        self.ffn = FeedForward(cfg.d_model, cfg.d_ff)
        self.norm2 = nn.LayerNorm(cfg.d_model)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None) -> torch.Tensor:  # (B, S, d)
        x = self.norm1(x + self.dropout(self.self_attn(x, attn_mask)))
        return self.norm2(x + self.dropout(self.ffn(x)))


class DecoderLayer(nn.Module):
    """Post-norm block with masked self-attention, cross-attention and FFN (§3.1)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = SelfAttention(cfg.d_model, cfg.n_heads)
        self.norm1 = nn.LayerNorm(cfg.d_model)
        self.cross_attn = CrossAttention(cfg.d_model, cfg.n_heads)
        self.norm2 = nn.LayerNorm(cfg.d_model)
        self.ffn = FeedForward(cfg.d_model, cfg.d_ff)
        self.norm3 = nn.LayerNorm(cfg.d_model)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, cross_kv: torch.Tensor, cross_mask: torch.Tensor,
                self_mask: torch.Tensor | None = None, is_causal: bool = False,
                cache: torch.Tensor | None = None, step: int = 0) -> torch.Tensor:  # (N, T, d)
        x = self.norm1(x + self.dropout(self.self_attn(x, self_mask, is_causal, cache, step)))
        x = self.norm2(x + self.dropout(self.cross_attn(x, cross_kv, cross_mask)))
        return self.norm3(x + self.dropout(self.ffn(x)))


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

    def reorder(self, indices: torch.Tensor) -> None:
        """Row r takes the history of row indices[r] (beam search). indices (N,) long must keep
        every row within its own sentence, i.e. indices[r] // beam_size == r // beam_size."""
        t = self.step
        if t > 0:
            self.self_kv[:, :, :, :, :t] = self.self_kv[:, :, :, :, :t].index_select(2, indices)


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
        self.dropout = nn.Dropout(cfg.dropout)  # §5.4: on the sums of embeddings and positions
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

    def num_parameters(self) -> int:
        """Trainable parameters, the shared embedding counted once."""
        return sum(p.numel() for p in self.parameters())

    def _embed(self, embed: nn.Embedding, ids: torch.Tensor, offset: int = 0) -> torch.Tensor:
        T = ids.shape[1]
        if offset + T > self.cfg.max_positions:
            raise ValueError(f"position {offset + T - 1} >= ModelConfig.max_positions={self.cfg.max_positions}")
        x = embed(ids) * self.emb_scale + self.pos_table[offset : offset + T]  # (B, T, d)
        return self.dropout(x)

    def encode(self, src_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """src_ids (B, S) -> memory (B, S, d), src_pad_mask (B, S) bool True = pad.
        Every row needs >= 1 real token (sources end with eos), or attention rows are all masked."""
        src_pad_mask = src_ids.eq(self.cfg.pad_id)  # (B, S)
        attn_mask = key_padding_to_attn_mask(src_pad_mask)  # (B, 1, 1, S)
        x = self._embed(self.src_embed, src_ids)
        for layer in self.encoder_layers:
            x = layer(x, attn_mask)
        return x, src_pad_mask

    def decode(self, tgt_in_ids: torch.Tensor, memory: torch.Tensor, src_pad_mask: torch.Tensor,
               keep: torch.Tensor | None = None) -> torch.Tensor:
        """Teacher-forced decoder: tgt_in_ids (B, T) -> logits (B, T, V), or (M, V) for the M
        positions where `keep` (B, T) is True. Self-attention uses the causal mask only: with
        right padding every pad key sits after every real query, so it is never attended to
        from a position whose output is used."""
        cross_mask = key_padding_to_attn_mask(src_pad_mask)  # (B, 1, 1, S)
        x = self._embed(self.tgt_embed, tgt_in_ids)  # (B, T, d)
        for layer in self.decoder_layers:
            x = layer(x, layer.cross_attn.project_kv(memory), cross_mask, is_causal=True)
        if keep is not None:
            x = x[keep]  # (M, d)
        return self.output_proj(x)  # (B, T, V) or (M, V)

    def forward(self, src_ids: torch.Tensor, tgt_in_ids: torch.Tensor, nonpad_only: bool = False) -> torch.Tensor:
        """src_ids (B, S) = pieces + [eos]; tgt_in_ids (B, T) = [bos] + pieces -> logits (B, T, V).

        nonpad_only=True returns logits (M, V) only at the M non-pad decoder positions, row-major:
        pair them with `tgt_out_ids[tgt_out_ids != pad_id]` (the same positions). It skips the
        vocabulary projection and the loss on padding, the largest matmul of a training step. It
        is a forward argument, not a separate method, so DDP-wrapped calls keep working."""
        memory, src_pad_mask = self.encode(src_ids)
        keep = tgt_in_ids.ne(self.cfg.pad_id) if nonpad_only else None
        return self.decode(tgt_in_ids, memory, src_pad_mask, keep=keep)

    def init_decoder_state(self, memory: torch.Tensor, src_pad_mask: torch.Tensor, beam_size: int = 1,
                           max_len: int | None = None) -> DecoderState:
        """State for decoding B sentences with `beam_size` rows each, for up to `max_len` fed tokens
        (bos included; default and maximum `cfg.max_positions`)."""
        max_len = self.cfg.max_positions if max_len is None else max_len
        if not 0 < max_len <= self.cfg.max_positions:
            raise ValueError(f"max_len={max_len} must be in [1, max_positions={self.cfg.max_positions}]")
        B, S, d = memory.shape
        h = self.cfg.n_heads
        cross_kv = torch.stack([layer.cross_attn.project_kv(memory) for layer in self.decoder_layers])
        self_kv = cross_kv.new_empty(len(self.decoder_layers), 2, B * beam_size, h, max_len, d // h)
        output_weight_t = self.output_proj.weight.t().contiguous()
        return DecoderState(self_kv, cross_kv, key_padding_to_attn_mask(src_pad_mask), output_weight_t, beam_size)

    def decode_step(self, prev_ids: torch.Tensor, state: DecoderState) -> torch.Tensor:
        """Feed one token per row at position `state.step`: prev_ids (N,) -> logits (N, V).
        Costs O(step) attention per row; advances `state.step`."""
        t = state.step
        if t >= state.self_kv.shape[4]:
            raise ValueError(f"decoder state holds {state.self_kv.shape[4]} positions; step {t} is past it")
        x = self._embed(self.tgt_embed, prev_ids.view(-1, 1), offset=t)  # (N, 1, d)
        for i, layer in enumerate(self.decoder_layers):
            x = layer(x, state.cross_kv[i], state.cross_mask, cache=state.self_kv[i], step=t)
        state.step = t + 1
        return x[:, 0] @ state.output_weight_t  # (N, V), = self.output_proj(x[:, 0])
