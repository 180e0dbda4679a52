"""Layers against torch.nn reference modules, parameter counts, config validation."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

from model import ModelConfig, Transformer
from model.compute import Mask, key_padding_to_attn_mask
from model.transformer import DecoderLayer, EncoderLayer

D, H, D_FF = 16, 4, 32


def _tiny_cfg(**kw) -> ModelConfig:
    return ModelConfig(vocab_size=11, d_model=D, d_ff=D_FF, n_heads=H, dropout=0.1, **kw)


def _randomize(module: nn.Module) -> None:
    torch.manual_seed(1)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, 0.3)


def _pad_mask(lengths: list[int], T: int) -> torch.Tensor:
    return torch.arange(T)[None, :] >= torch.tensor(lengths)[:, None]  # (B, T) True = pad


def _copy_self_attn(ours, ref: nn.MultiheadAttention) -> None:
    ours.qkv_proj.weight.copy_(ref.in_proj_weight)
    ours.qkv_proj.bias.copy_(ref.in_proj_bias)
    ours.out_proj.load_state_dict(ref.out_proj.state_dict())


def _copy_common(ours, ref) -> None:
    ours.ffn.w1.load_state_dict(ref.linear1.state_dict())
    ours.ffn.w2.load_state_dict(ref.linear2.state_dict())
    ours.norm1.load_state_dict(ref.norm1.state_dict())
    ours.norm2.load_state_dict(ref.norm2.state_dict())


@pytest.fixture(autouse=True)
def _no_mha_fastpath():
    # The fast path returns zeros at padded positions; the math path is the reference.
    before = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    yield
    torch.backends.mha.set_fastpath_enabled(before)


def test_encoder_layer_matches_torch_reference():
    ref = nn.TransformerEncoderLayer(D, H, D_FF, dropout=0.1, activation="relu", batch_first=True,
                                     norm_first=False).eval()
    _randomize(ref)
    ours = EncoderLayer(_tiny_cfg()).eval()
    with torch.no_grad():
        _copy_self_attn(ours.self_attn, ref.self_attn)
        _copy_common(ours, ref)
    x = torch.randn(3, 7, D)
    pad = _pad_mask([7, 4, 1], 7)
    with torch.no_grad():
        expected = ref(x, src_key_padding_mask=pad)
        got = ours(x, Mask(keys=key_padding_to_attn_mask(pad)))
    assert (got - expected).abs().max() < 1e-5


def test_decoder_layer_matches_torch_reference():
    ref = nn.TransformerDecoderLayer(D, H, D_FF, dropout=0.1, activation="relu", batch_first=True,
                                     norm_first=False).eval()
    _randomize(ref)
    ours = DecoderLayer(_tiny_cfg()).eval()
    with torch.no_grad():
        _copy_self_attn(ours.self_attn, ref.self_attn)
        w, b = ref.multihead_attn.in_proj_weight, ref.multihead_attn.in_proj_bias
        ours.cross_attn.q_proj.weight.copy_(w[:D]), ours.cross_attn.q_proj.bias.copy_(b[:D])
        ours.cross_attn.kv_proj.weight.copy_(w[D:]), ours.cross_attn.kv_proj.bias.copy_(b[D:])
        ours.cross_attn.out_proj.load_state_dict(ref.multihead_attn.out_proj.state_dict())
        _copy_common(ours, ref)
        ours.norm3.load_state_dict(ref.norm3.state_dict())
    T, S = 6, 5
    x, memory = torch.randn(3, T, D), torch.randn(3, S, D)
    tgt_pad, mem_pad = _pad_mask([6, 3, 1], T), _pad_mask([2, 5, 4], S)
    causal = torch.ones(T, T, dtype=torch.bool).triu(1)  # True = masked (nn convention)
    with torch.no_grad():
        expected = ref(x, memory, tgt_mask=causal, tgt_key_padding_mask=tgt_pad,
                       memory_key_padding_mask=mem_pad)
        kv, cross_mask = ours.cross_attn.project_kv(memory), key_padding_to_attn_mask(mem_pad)
        self_mask = ~(causal[None, None] | tgt_pad[:, None, None, :])  # (B, 1, T, T) True = attend
        got = ours(x, kv, Mask(keys=self_mask), Mask(keys=cross_mask))
        got_causal_only = ours(x, kv, Mask(causal=True), Mask(keys=cross_mask))
    assert (got - expected).abs().max() < 1e-5
    # The model path (causal mask only) agrees wherever the target is real (right padding).
    assert (got_causal_only - expected)[~tgt_pad].abs().max() < 1e-5


def _closed_form_count(V: int, d: int, d_ff: int, n_enc: int, n_dec: int) -> int:
    attn = 4 * (d * d + d)  # W_Q, W_K, W_V, W_O with biases
    ffn = d * d_ff + d_ff + d_ff * d + d
    layer_norm = 2 * d
    encoder_layer = attn + ffn + 2 * layer_norm
    decoder_layer = 2 * attn + ffn + 3 * layer_norm
    return V * d + n_enc * encoder_layer + n_dec * decoder_layer  # one tied V x d matrix


def test_parameter_count_base_and_big():
    base = Transformer(ModelConfig.base(37000))
    assert base.num_parameters() == _closed_form_count(37000, 512, 2048, 6, 6) == 63_082_496
    big_cfg = ModelConfig.big(37000, n_encoder_layers=1, n_decoder_layers=1)  # keep the test light
    per_layer_pair = _closed_form_count(0, 1024, 4096, 1, 1)
    assert Transformer(big_cfg).num_parameters() == 37000 * 1024 + per_layer_pair
    assert _closed_form_count(37000, 1024, 4096, 6, 6) == 37000 * 1024 + 6 * per_layer_pair == 214_245_376


def test_three_way_tying_and_untied():
    m = Transformer(_tiny_cfg())
    assert m.src_embed.weight is m.tgt_embed.weight is m.output_proj.weight
    untied = Transformer(_tiny_cfg(tie_embeddings=False))
    assert untied.num_parameters() == m.num_parameters() + 2 * 11 * D
    assert "pos_table" not in m.state_dict()


def test_init_scales():
    torch.manual_seed(0)
    m = Transformer(ModelConfig.base(2000, n_encoder_layers=1, n_decoder_layers=1))
    emb = m.src_embed.weight
    assert abs(emb[1:].std().item() - 512 ** -0.5) < 2e-3 and emb[0].abs().sum() == 0
    w = m.encoder_layers[0].ffn.w1.weight  # xavier_uniform bound sqrt(6 / (fan_in + fan_out))
    assert w.abs().max() <= (6 / (512 + 2048)) ** 0.5 and w.abs().max() > 0.9 * (6 / (512 + 2048)) ** 0.5
    qkv = m.encoder_layers[0].self_attn.qkv_proj.weight
    assert qkv.abs().max() <= (6 / 1024) ** 0.5
    assert m.encoder_layers[0].self_attn.qkv_proj.bias.abs().sum() == 0


def test_config_validation_and_round_trip():
    cfg = ModelConfig.big(37000, max_positions=300)
    assert (cfg.d_model, cfg.d_ff, cfg.n_heads, cfg.dropout) == (1024, 4096, 16, 0.3)
    assert ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    with pytest.raises(ValueError, match="n_heads"):
        ModelConfig(vocab_size=100, d_model=30, n_heads=8)
    with pytest.raises(ValueError, match="eos_id"):
        ModelConfig(vocab_size=3)
    with pytest.raises(ValueError, match="d_ff"):
        ModelConfig(vocab_size=100, d_ff=0)
    with pytest.raises(ValueError, match="bogus"):
        ModelConfig.from_dict({"vocab_size": 100, "bogus": 1})
    with pytest.raises(ValueError, match="bogus"):
        ModelConfig.base(100, bogus=1)
    with pytest.raises(TypeError, match="d_model"):
        ModelConfig(vocab_size=100, d_model="512")
    with pytest.raises(TypeError, match="tie_embeddings"):
        ModelConfig(vocab_size=100, tie_embeddings=1)
