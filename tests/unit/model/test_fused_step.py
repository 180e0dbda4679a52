"""`incremental.decoder_layer_step`, the hand-fused decoder step with its KV cache and the beams folded
into the cross-attention's queries, against the layer it fuses (`DecoderLayer.forward`, teacher-forced
over the whole prefix, each beam a sentence of its own), and the whole incremental decoder against the
model's forward at every value of every `ModelConfig` field."""

from __future__ import annotations

import pytest
import torch

from model import ModelConfig
from model.incremental import LayerWeights, decoder_layer_step
from model.compute import Mask, key_padding_to_attn_mask
from model.transformer import DecoderLayer


@pytest.mark.parametrize("heads", [dict(), dict(d_k=4, d_v=12), dict(d_k=12, d_v=4)])
@pytest.mark.parametrize("beam", [1, 3])
@torch.no_grad()
def test_fused_step_equals_the_layers_forward_over_the_prefix(beam, heads):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=11, d_model=32, d_ff=64, n_heads=4, dropout=0.3, **heads)
    layer = DecoderLayer(cfg).eval()  # eval: no dropout, as decoding
    B, S, steps, h, hs = 2, 5, 4, 4, layer.self_attn.heads.hs
    N = B * beam
    memory = torch.randn(B, S, 32)
    src_pad = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    cross_kv, cross_mask = layer.cross_attn.project_kv(memory), key_padding_to_attn_mask(src_pad)
    # The reference: each of the N rows a sentence of its own, its sentence's memory copied.
    row_kv, row_mask = cross_kv.repeat_interleave(beam, dim=1), cross_mask.repeat_interleave(beam, dim=0)
    cache = torch.zeros(2, N, h, steps, hs)
    weights = LayerWeights.of(layer)
    prefix = torch.randn(N, steps, 32)
    for t in range(steps):
        want = layer(prefix[:, : t + 1], row_kv, Mask(causal=True), Mask(keys=row_mask))[:, t]  # (N, d)
        got = decoder_layer_step(weights, prefix[:, t].clone(), cross_kv, cross_mask, cache, t)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_layer_weights_are_transposed_copies_of_the_layer():
    layer = DecoderLayer(ModelConfig(vocab_size=11, d_model=16, d_ff=24, n_heads=2))
    w = LayerWeights.of(layer)
    assert (w.heads.n_heads, w.heads.hs, w.eps) == (2, 8, layer.norm1.eps)
    assert torch.equal(w.qkv[0], layer.self_attn.qkv_proj.weight.t()) and w.qkv[0].is_contiguous()
    assert torch.equal(w.ffn1[0], layer.ffn.w1.weight.t()) and w.ffn2[0].shape == (24, 16)
    assert w.norm3[0] is layer.norm3.weight and w.cross_out[1] is layer.cross_attn.out_proj.bias


# Every ModelConfig field, and the values the decoding check below runs it at (on top of BASE).
# Literal and bool fields run at each of their values, read from the annotations, so a new option
# value is checked without editing this table; a new field of another type fails
# `test_every_model_field_is_a_checked_variant` until it is listed here.
BASE = dict(vocab_size=23, d_model=32, d_ff=64, n_heads=4, n_encoder_layers=2, n_decoder_layers=2,
            max_positions=40, dropout=0.1)
VALUES = {"vocab_size": [23, 31], "d_model": [32, 48], "d_ff": [64, 40], "n_heads": [4, 2], "d_k": [None, 4, 12],
          "d_v": [None, 12], "n_encoder_layers": [2, 1], "n_decoder_layers": [2, 3], "dropout": [0.1, 0.0],
          "max_positions": [40, 9], "pad_id": [0], "bos_id": [2, 5], "eos_id": [3, 6]}


def _values(field: str) -> list | None:
    """The values the check runs `field` at; None for a field it does not know."""
    import typing

    hint = typing.get_type_hints(ModelConfig)[field]
    if typing.get_origin(hint) is typing.Literal:
        return list(typing.get_args(hint))
    if hint is bool:
        return [True, False]
    return VALUES.get(field)


def _variants():
    import dataclasses

    for f in dataclasses.fields(ModelConfig):
        for value in _values(f.name) or []:
            yield pytest.param({f.name: value}, id=f"{f.name}={value}")


def test_every_model_field_is_a_checked_variant():
    import dataclasses

    unchecked = [f.name for f in dataclasses.fields(ModelConfig) if _values(f.name) is None]
    assert not unchecked, f"ModelConfig fields no decoding check runs: {unchecked}; add their values to VALUES"


@pytest.mark.parametrize("beam", [1, 3])
@pytest.mark.parametrize("variant", list(_variants()))
@torch.no_grad()
def test_every_variant_decodes_as_it_trains(variant, beam):
    """Search's incremental step gives the teacher-forced forward's logits at every position, for
    each value of each ModelConfig field: a variant that reaches the layers and not the fused step
    fails here."""
    from model import Transformer

    cfg = ModelConfig(**{**BASE, **variant})
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    g = torch.Generator().manual_seed(1)
    B, S, T = 3, 6, min(6, cfg.max_positions)
    special = {cfg.pad_id, cfg.bos_id, cfg.eos_id}
    words = torch.tensor([i for i in range(cfg.vocab_size) if i not in special])
    src, tgt_in = (words[torch.randint(len(words), (B, n), generator=g)] for n in (S, T))
    for b, n in enumerate([S, 4, 2]):
        src[b, n - 1], src[b, n:] = cfg.eos_id, cfg.pad_id
    tgt_in[:, 0] = cfg.bos_id
    full = model.logits(model(src, tgt_in))  # (B, T, V)
    memory, src_pad_mask = model.encode(src)
    state = model.init_decoder_state(memory, src_pad_mask, beam_size=beam, max_len=T)
    for t in range(T):
        logits = model.decode_step(tgt_in[:, t].repeat_interleave(beam), state).view(B, beam, -1)
        for j in range(beam):
            torch.testing.assert_close(logits[:, j], full[:, t], rtol=1e-4, atol=1e-4, msg=f"{variant} step {t}")
