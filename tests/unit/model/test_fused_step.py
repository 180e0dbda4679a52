"""`incremental.decoder_layer_step`, the hand-fused eval-mode decoder step, against the module it
fuses: `DecoderLayer.forward` with a cache (eval mode, d_k = d_v), step by step, beams included."""

from __future__ import annotations

import pytest
import torch

from model import ModelConfig
from model.incremental import LayerWeights, decoder_layer_step
from model.padding import key_padding_to_attn_mask
from model.transformer import DecoderLayer


@pytest.mark.parametrize("beam", [1, 3])
@torch.no_grad()
def test_fused_step_equals_decoder_layer_forward_with_a_cache(beam):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=11, d_model=32, d_ff=64, n_heads=4, dropout=0.3)
    layer = DecoderLayer(cfg).eval()  # eval: no dropout, as the fused step assumes
    B, S, steps, h, hs = 2, 5, 4, 4, 8
    N = B * beam
    memory = torch.randn(B, S, 32)
    src_pad = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    cross_kv, cross_mask = layer.cross_attn.project_kv(memory), key_padding_to_attn_mask(src_pad)
    module_cache = torch.zeros(2, N, h, steps, hs)
    fused_cache = torch.zeros(2, N, h, steps, hs)
    weights = LayerWeights.of(layer)
    for t in range(steps):
        x = torch.randn(N, 32)
        want = layer(x[:, None], cross_kv, cross_mask, cache=module_cache, step=t)[:, 0]  # (N, d)
        got = decoder_layer_step(weights, x.clone(), cross_kv, cross_mask, fused_cache, t)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(fused_cache[:, :, :, : t + 1], module_cache[:, :, :, : t + 1], rtol=1e-5,
                                   atol=1e-5)


def test_layer_weights_are_transposed_copies_of_the_layer():
    layer = DecoderLayer(ModelConfig(vocab_size=11, d_model=16, d_ff=24, n_heads=2))
    w = LayerWeights.of(layer)
    assert (w.n_heads, w.hs, w.eps) == (2, 8, layer.norm1.eps)
    assert torch.equal(w.qkv[0], layer.self_attn.qkv_proj.weight.t()) and w.qkv[0].is_contiguous()
    assert torch.equal(w.ffn1[0], layer.ffn.w1.weight.t()) and w.ffn2[0].shape == (24, 16)
    assert w.norm3[0] is layer.norm3.weight and w.cross_out[1] is layer.cross_attn.out_proj.bias
