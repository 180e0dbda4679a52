"""Table 3's model variations: d_k / d_v independent of d_model / h (rows A, B), learned positions (E).

References: the attention formula of §3.2.1-3.2.2 written out per head with plain matmuls (not
the fused, padded code under test), closed-form parameter counts, and the model's own teacher-
forced forward against its incremental decoder (`incremental.decoder_layer_step`, padded heads
included).
"""

from __future__ import annotations

import math

import pytest
import torch

from model import ModelConfig, Transformer
from model.compute import Mask, Positions
from model.transformer import CrossAttention, SelfAttention

PAD, BOS, EOS = 0, 2, 3


def _reference_attention(x, memory, w_q, b_q, w_k, b_k, w_v, b_v, w_o, b_o, h, d_k, d_v, mask):
    """MultiHead(Q, K, V) = Concat(head_1..head_h) W_O, head_i = softmax(Q W_i^Q (K W_i^K)^T / sqrt(d_k)) V W_i^V."""
    heads = []
    for i in range(h):
        q = x @ w_q[i * d_k:(i + 1) * d_k].T + b_q[i * d_k:(i + 1) * d_k]  # (B, T, d_k)
        k = memory @ w_k[i * d_k:(i + 1) * d_k].T + b_k[i * d_k:(i + 1) * d_k]  # (B, S, d_k)
        v = memory @ w_v[i * d_v:(i + 1) * d_v].T + b_v[i * d_v:(i + 1) * d_v]  # (B, S, d_v)
        scores = (q @ k.transpose(1, 2)) / math.sqrt(d_k)
        scores = scores.masked_fill(~mask, float("-inf"))
        heads.append(torch.softmax(scores, dim=-1) @ v)
    return torch.cat(heads, dim=-1) @ w_o.T + b_o


def _randomized(module):
    torch.manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, 0.4)
    return module.eval()


@pytest.mark.parametrize("d_k, d_v", [(3, 5), (5, 3), (4, 4), (8, 8)])
def test_self_attention_with_any_head_widths_is_the_papers_formula(d_k, d_v):
    d, h, B, T = 12, 3, 2, 5
    attn = _randomized(SelfAttention(d, h, d_k, d_v))
    assert attn.qkv_proj.weight.shape == (h * (2 * d_k + d_v), d) and attn.out_proj.weight.shape == (d, h * d_v)
    x = torch.randn(B, T, d)
    w, b = attn.qkv_proj.weight, attn.qkv_proj.bias
    split = [h * d_k, h * d_k, h * d_v]
    (w_q, w_k, w_v), (b_q, b_k, b_v) = w.split(split), b.split(split)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    with torch.no_grad():
        expected = _reference_attention(x, x, w_q, b_q, w_k, b_k, w_v, b_v, attn.out_proj.weight,
                                        attn.out_proj.bias, h, d_k, d_v, causal)
        got = attn(x, Mask(causal=True))
        keep = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.bool)  # right padding
        at = Positions(keep)
        got_packed = at.unpack(attn(at.pack(x), Mask(causal=True, at=at)))
    assert (got - expected).abs().max() < 1e-5
    # Packed (real positions only): row 1's real positions see only real keys before them.
    assert (got_packed[keep] - expected[keep]).abs().max() < 1e-5


@pytest.mark.parametrize("d_k, d_v", [(3, 5), (6, 2)])
def test_cross_attention_with_any_head_widths_is_the_papers_formula(d_k, d_v):
    d, h, B, T, S = 12, 3, 2, 4, 6
    attn = _randomized(CrossAttention(d, h, d_k, d_v))
    x, memory = torch.randn(B, T, d), torch.randn(B, S, d)
    src_keep = torch.tensor([[1] * 6, [1, 1, 1, 0, 0, 0]], dtype=torch.bool)
    (w_k, w_v), (b_k, b_v) = attn.kv_proj.weight.split([h * d_k, h * d_v]), attn.kv_proj.bias.split([h * d_k, h * d_v])
    mask = src_keep[:, None, :].expand(B, T, S)
    with torch.no_grad():
        expected = _reference_attention(x, memory, attn.q_proj.weight, attn.q_proj.bias, w_k, b_k, w_v, b_v,
                                        attn.out_proj.weight, attn.out_proj.bias, h, d_k, d_v, mask)
        got = attn(x, attn.project_kv(memory), Mask(keys=src_keep[:, None, None, :]))
    assert (got - expected).abs().max() < 1e-5


def _closed_form_count(V, d, d_ff, n_enc, n_dec, h, d_k, d_v, learned_positions=0):
    self_attn = d * h * (2 * d_k + d_v) + h * (2 * d_k + d_v) + h * d_v * d + d
    cross_attn = self_attn  # W_Q from the decoder, W_K / W_V from memory: the same shapes
    ffn = d * d_ff + d_ff + d_ff * d + d
    enc = self_attn + ffn + 2 * 2 * d
    dec = self_attn + cross_attn + ffn + 3 * 2 * d
    return V * d + n_enc * enc + n_dec * dec + learned_positions * d


@pytest.mark.parametrize("kw", [dict(d_k=16), dict(d_k=32, d_v=128), dict(n_heads=1, d_k=512, d_v=512),
                                dict(n_heads=32, d_k=16, d_v=16), dict(positional="learned")])
def test_parameter_counts_follow_the_head_widths(kw):
    cfg = ModelConfig.base(1000, n_encoder_layers=2, n_decoder_layers=1, max_positions=300, **kw)
    d_k, d_v = cfg.head_dims
    expected = _closed_form_count(1000, 512, 2048, 2, 1, cfg.n_heads, d_k, d_v,
                                  300 if cfg.positional == "learned" else 0)
    assert Transformer(cfg).num_parameters() == expected


def test_head_widths_default_to_d_model_over_h_and_are_validated():
    assert ModelConfig.base(100).head_dims == (64, 64)
    assert ModelConfig.base(100, d_k=16).head_dims == (16, 64)
    assert ModelConfig(vocab_size=100, d_model=30, n_heads=4, d_k=8, d_v=8).head_dims == (8, 8)  # 30 % 4 != 0
    with pytest.raises(ValueError, match="divisible"):
        ModelConfig(vocab_size=100, d_model=30, n_heads=4, d_k=8)  # d_v would be 30 / 4
    with pytest.raises(ValueError, match="d_k must be positive"):
        ModelConfig.base(100, d_k=0)
    with pytest.raises(ValueError, match="positional"):
        ModelConfig.base(100, positional="relative")
    with pytest.raises(ValueError, match="positional = 'rotary' rotates pairs"):
        ModelConfig.base(100, positional="rotary", d_k=15)
    with pytest.raises(TypeError, match="d_v"):
        ModelConfig.base(100, d_v=2.5)


def _batch(V):
    g = torch.Generator().manual_seed(0)
    src = torch.randint(4, V, (3, 7), generator=g)
    for b, n in enumerate([7, 4, 2]):
        src[b, n - 1], src[b, n:] = EOS, PAD
    tgt_in = torch.randint(4, V, (3, 6), generator=g)
    tgt_in[:, 0] = BOS
    tgt_in[1, 4:] = PAD
    return src, tgt_in


@pytest.mark.parametrize("kw", [dict(d_k=3, d_v=10), dict(d_k=10, d_v=3), dict(d_k=12, d_v=12),
                                dict(positional="learned")])
@torch.no_grad()
def test_incremental_decoding_equals_forward_and_is_causal(kw):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=23, d_model=32, d_ff=64, n_heads=4, n_encoder_layers=2, n_decoder_layers=2,
                      max_positions=40, **kw)
    model = Transformer(cfg).eval()
    src, tgt_in = _batch(23)
    full = model.logits(model(src, tgt_in))
    memory, src_pad_mask = model.encode(src)
    k = 2
    state = model.init_decoder_state(memory.repeat_interleave(1, 0), src_pad_mask, beam_size=k,
                                     max_len=tgt_in.shape[1])
    rows = tgt_in.repeat_interleave(k, dim=0)
    for t in range(tgt_in.shape[1]):
        step = model.decode_step(rows[:, t], state)  # (B * k, V)
        assert (step[::k] - full[:, t]).abs().max() < 1e-4, t
    # Causality: changing the last two decoder inputs leaves earlier positions' logits unchanged.
    changed = tgt_in.clone()
    changed[0, 4:] = torch.tensor([5, 6])
    assert (model.logits(model(src, changed))[0, :4] - full[0, :4]).abs().max() < 1e-5
    assert (model.logits(model(src, changed))[0, 4:] - full[0, 4:]).abs().max() > 1e-4


def test_learned_positions_are_a_trained_parameter_in_place_of_sinusoids():
    cfg = ModelConfig(vocab_size=23, d_model=16, d_ff=32, n_heads=4, max_positions=40, positional="learned")
    model = Transformer(cfg)
    sinusoid = Transformer(ModelConfig(vocab_size=23, d_model=16, d_ff=32, n_heads=4, max_positions=40))
    assert model.num_parameters() == sinusoid.num_parameters() + 40 * 16
    assert "pos_embed.weight" in model.state_dict() and sinusoid.pos_embed is None
    src, tgt_in = _batch(23)
    model.train()
    logits = model.logits(model(src, tgt_in))
    logits.sum().backward()
    assert model.pos_embed.weight.grad is not None and model.pos_embed.weight.grad.abs().sum() > 0
    model.eval()
    with torch.no_grad():
        before = model.logits(model(src, tgt_in))
        model.pos_embed.weight[1].add_(1.0)  # position 1 only
        after = model.logits(model(src, tgt_in))
    assert (before - after).abs().max() > 1e-4  # the positions are what the model reads


def test_named_sizes_are_one_table():
    from model import SIZES, size_name

    assert size_name(ModelConfig.base(100)) == "base" and size_name(ModelConfig.big(100)) == "big"
    assert size_name(ModelConfig(vocab_size=100, **SIZES["tiny"])) == "tiny"
    assert size_name(ModelConfig.base(100, n_encoder_layers=4)) is None
    assert size_name(ModelConfig.base(100, n_encoder_layers=4), keys=("d_model", "d_ff", "n_heads")) == "base"
    assert ModelConfig.big(100).dropout == 0.3 and ModelConfig.base(100).dropout == 0.1
