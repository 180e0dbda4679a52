"""The options after 2017 (pre-norm, RMSNorm, SwiGLU, rotary positions) against independent
references: torch.nn's norm_first Transformer layers, the RMSNorm formula, transformers' Llama MLP
and rotary embedding. That decoding equals the forward for each is tests/unit/model/test_fused_step.py;
that CTranslate2 holds each, tests/unit/serve/test_ct2_spec.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from model import ModelConfig, Transformer
from model.compute import Mask, key_padding_to_attn_mask
from model.transformer import DecoderLayer, EncoderLayer, FeedForward, Rotary, make_norm

D, H, D_FF = 16, 4, 32


def _cfg(**kw) -> ModelConfig:
    return ModelConfig(vocab_size=11, d_model=D, d_ff=D_FF, n_heads=H, dropout=0.1, **kw)


def _pad_mask(lengths: list[int], T: int) -> torch.Tensor:
    return torch.arange(T)[None, :] >= torch.tensor(lengths)[:, None]  # (B, T) True = pad


@pytest.fixture(autouse=True)
def _no_mha_fastpath():
    before = torch.backends.mha.get_fastpath_enabled()  # its zeros at padding are not the reference's
    torch.backends.mha.set_fastpath_enabled(False)
    yield
    torch.backends.mha.set_fastpath_enabled(before)


def _torch_norm_first(cls, norm: str, n_norms: int) -> nn.Module:
    """torch.nn's pre-norm layer (norm_first=True), random weights; its norms RMSNorm for "rmsnorm"."""
    torch.manual_seed(1)
    ref = cls(D, H, D_FF, dropout=0.1, activation="relu", batch_first=True, norm_first=True, layer_norm_eps=1e-5)
    if norm == "rmsnorm":
        for i in range(1, n_norms + 1):
            setattr(ref, f"norm{i}", nn.RMSNorm(D, eps=1e-5))
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0.0, 0.3)
    return ref.eval()


def _load_common(ours, ref, n_norms: int) -> None:
    ours.self_attn.qkv_proj.weight.copy_(ref.self_attn.in_proj_weight)
    ours.self_attn.qkv_proj.bias.copy_(ref.self_attn.in_proj_bias)
    ours.self_attn.out_proj.load_state_dict(ref.self_attn.out_proj.state_dict())
    ours.ffn.w1.load_state_dict(ref.linear1.state_dict())
    ours.ffn.w2.load_state_dict(ref.linear2.state_dict())
    for i in range(1, n_norms + 1):
        getattr(ours, f"norm{i}").load_state_dict(getattr(ref, f"norm{i}").state_dict())


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
@torch.no_grad()
def test_pre_norm_encoder_layer_is_torchs_norm_first_layer(norm):
    ref = _torch_norm_first(nn.TransformerEncoderLayer, norm, 2)
    ours = EncoderLayer(_cfg(norm_position="pre", norm=norm)).eval()
    _load_common(ours, ref, 2)
    x, pad = torch.randn(3, 7, D), _pad_mask([7, 4, 1], 7)
    torch.testing.assert_close(ours(x, Mask(keys=key_padding_to_attn_mask(pad))), ref(x, src_key_padding_mask=pad),
                               rtol=0, atol=1e-5)


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
@torch.no_grad()
def test_pre_norm_decoder_layer_is_torchs_norm_first_layer(norm):
    ref = _torch_norm_first(nn.TransformerDecoderLayer, norm, 3)
    ours = DecoderLayer(_cfg(norm_position="pre", norm=norm)).eval()
    _load_common(ours, ref, 3)
    w, b = ref.multihead_attn.in_proj_weight, ref.multihead_attn.in_proj_bias
    ours.cross_attn.q_proj.weight.copy_(w[:D]), ours.cross_attn.q_proj.bias.copy_(b[:D])
    ours.cross_attn.kv_proj.weight.copy_(w[D:]), ours.cross_attn.kv_proj.bias.copy_(b[D:])
    ours.cross_attn.out_proj.load_state_dict(ref.multihead_attn.out_proj.state_dict())
    T, S = 6, 5
    x, memory, mem_pad = torch.randn(3, T, D), torch.randn(3, S, D), _pad_mask([2, 5, 4], S)
    causal = torch.ones(T, T, dtype=torch.bool).triu(1)  # True = masked (nn convention)
    want = ref(x, memory, tgt_mask=causal, memory_key_padding_mask=mem_pad)
    got = ours(x, ours.cross_attn.project_kv(memory), Mask(causal=True), Mask(keys=key_padding_to_attn_mask(mem_pad)))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@torch.no_grad()
def test_rmsnorm_is_the_formula_with_our_eps_and_no_bias():
    norm = make_norm(_cfg(norm="rmsnorm"))
    assert [name for name, _ in norm.named_parameters()] == ["weight"]
    norm.weight.normal_()
    x = 1e-3 * torch.randn(4, D, dtype=torch.float64)  # mean(x^2) ~ 1e-6: the eps (1e-5) weighs in
    want = norm.weight.double() * x / torch.sqrt(x.square().mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(norm(x.float()).double(), want, rtol=1e-5, atol=1e-6)


@torch.no_grad()
def test_swiglu_is_llamas_mlp_and_keeps_d_ff_as_the_inner_width():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    ref = LlamaMLP(LlamaConfig(hidden_size=D, intermediate_size=D_FF, num_attention_heads=H, mlp_bias=True,
                               hidden_act="silu")).eval()
    for p in ref.parameters():
        p.normal_(0.0, 0.3)
    ours = FeedForward(D, D_FF, gated=True)
    ours.w1.load_state_dict(ref.gate_proj.state_dict())  # silu(x W1 + b1): the gate
    ours.w3.load_state_dict(ref.up_proj.state_dict())  # x W3 + b3
    ours.w2.load_state_dict(ref.down_proj.state_dict())
    x = torch.randn(5, 3, D)
    torch.testing.assert_close(ours(x), ref(x), rtol=0, atol=1e-5)
    plain = sum(p.numel() for p in FeedForward(D, D_FF).parameters())
    assert sum(p.numel() for p in ours.parameters()) == plain + D * D_FF + D_FF  # W3 and b3


def test_parameter_counts_of_each_option():
    def count(**kw) -> int:
        return Transformer(_cfg(n_encoder_layers=2, n_decoder_layers=3, **kw)).num_parameters()

    base, norms = count(), 2 * 2 + 3 * 3  # norms: 2 per encoder layer, 3 per decoder layer
    assert count(ffn="swiglu") == base + 5 * (D * D_FF + D_FF)
    assert count(norm="rmsnorm") == base - norms * D  # no bias
    assert count(norm_position="pre") == base + 2 * 2 * D  # a final LayerNorm per stack
    assert count(norm_position="pre", norm="rmsnorm") == base - norms * D + 2 * D
    assert count(positional="rotary") == base  # nothing learned


@pytest.mark.parametrize("d_k, hs", [(8, 8), (6, 8)])  # (6, 8): d_k 6 in heads padded to d_v = 8
@torch.no_grad()
def test_rotary_is_llamas_rotation_on_interleaved_pairs(d_k, hs):
    """Llama rotates the halves (x_i, x_i+d_k/2) (GPT-NeoX's layout); Su et al. and we rotate the
    interleaved pairs (x_2i, x_2i+1) at the same frequencies: the same map up to that permutation.
    A head's zero padding stays zero."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    T, start = 5, 3
    llama = LlamaRotaryEmbedding(LlamaConfig(hidden_size=H * d_k, num_attention_heads=H, head_dim=d_k))
    q, k = torch.randn(2, H, T, hs), torch.randn(2, H, T, hs)
    q[..., d_k:], k[..., d_k:] = 0, 0
    halves = torch.cat([torch.arange(0, d_k, 2), torch.arange(1, d_k, 2)])  # ours[..., halves] = Llama's layout
    cos, sin = llama(q, torch.arange(start, start + T)[None].expand(2, T))
    want_q, want_k = apply_rotary_pos_emb(q[..., halves], k[..., halves], cos, sin)
    rotary = Rotary(d_k, hs, 16)
    torch.testing.assert_close(rotary(q, start)[..., halves], want_q, rtol=0, atol=1e-5)
    torch.testing.assert_close(rotary(k, start)[..., halves], want_k, rtol=0, atol=1e-5)
    assert not rotary(q, start)[..., d_k:].any()


@torch.no_grad()
def test_rotary_scores_depend_on_the_offset_only():
    rotary = Rotary(8, 8, 40)
    q, k = torch.randn(8), torch.randn(8)

    def score(m: int, n: int) -> float:
        return float(rotary(q[None], m)[0] @ rotary(k[None], n)[0])

    assert abs(score(5, 2) - score(30, 27)) < 1e-4 and abs(score(5, 2) - score(2, 5)) > 1e-3


@torch.no_grad()
def test_rotary_adds_nothing_to_the_embeddings_and_decodes_as_it_trains_with_padded_heads():
    cfg = ModelConfig(vocab_size=23, d_model=32, d_ff=64, n_heads=4, n_encoder_layers=2, n_decoder_layers=2,
                      max_positions=40, positional="rotary", d_k=6, d_v=10)
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    assert model.position_table().abs().max() == 0
    ids = torch.tensor([[5, 6, 7]])
    torch.testing.assert_close(model.embed(model.src_embed, ids), model.src_embed(ids) * 32 ** 0.5)
    src, tgt_in = torch.tensor([[5, 9, 11, 7, 3], [6, 8, 3, 0, 0]]), torch.tensor([[2, 14, 15, 16], [2, 17, 18, 19]])
    full = model.logits(model(src, tgt_in))
    state = model.init_decoder_state(*model.encode(src), beam_size=1, max_len=4)
    for t in range(4):
        torch.testing.assert_close(model.decode_step(tgt_in[:, t], state), full[:, t], rtol=1e-4, atol=1e-4)
