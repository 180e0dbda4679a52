"""model.attention_weights.attention_weights: the maps a model computes, checked against torch's own
nn.MultiheadAttention (need_weights, per head) and for the properties a softmax row must have."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from model import ModelConfig, Transformer
from model.attention_weights import attention_weights
from model.transformer import ScaledDotProductAttention

CFG = dict(vocab_size=50, d_model=32, d_ff=64, n_heads=4, n_encoder_layers=2, n_decoder_layers=3, dropout=0.1,
           max_positions=64)


def _model(**kw) -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig(**{**CFG, **kw}))


def test_shapes_rows_sum_to_one_and_causal():
    model = _model()
    src, tgt = [5, 9, 11, 7, 3], [2, 8, 13, 21]
    maps = attention_weights(model, src, tgt)
    assert maps["encoder_self"].shape == (2, 4, 5, 5)
    assert maps["decoder_self"].shape == (3, 4, 4, 4)
    assert maps["cross"].shape == (3, 4, 4, 5)
    for m in maps.values():
        assert torch.all(m >= 0)
        torch.testing.assert_close(m.sum(-1), torch.ones(m.shape[:-1]))
    upper = torch.ones(4, 4, dtype=torch.bool).triu(1)
    assert torch.all(maps["decoder_self"][..., upper] == 0), "a decoder query attended to a later position"
    assert model.training, "the caller's train/eval mode is restored"


def test_encoder_first_layer_equals_multihead_attention_weights():
    """Layer 1's encoder self-attention = torch's MultiheadAttention weights on the same input
    (the embedded source) with the same projections: an independent computation of softmax(QK^T/sqrt(d_k))."""
    model = _model().eval()
    src = [5, 9, 11, 7, 3]
    maps = attention_weights(model, src, [2, 8])
    d, h = CFG["d_model"], CFG["n_heads"]
    ref = nn.MultiheadAttention(d, h, batch_first=True)
    attn = model.encoder_layers[0].self_attn
    with torch.no_grad():
        ref.in_proj_weight.copy_(attn.qkv_proj.weight)
        ref.in_proj_bias.copy_(attn.qkv_proj.bias)
    x = _embedded(model, src)  # the encoder's first-layer input: scaled embeddings + positions
    _, weights = ref(x, x, x, need_weights=True, average_attn_weights=False)
    torch.testing.assert_close(maps["encoder_self"][0], weights[0].detach(), atol=1e-5, rtol=1e-4)


def _embedded(model: Transformer, src: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model.embed(model.src_embed, torch.tensor([src]))


def test_outputs_unchanged_and_cross_differs_per_source():
    model = _model().eval()
    src, tgt = torch.tensor([[5, 9, 11, 7, 3]]), torch.tensor([[2, 8, 13]])
    before = model(src, tgt)
    maps = attention_weights(model, src[0].tolist(), tgt[0].tolist())
    torch.testing.assert_close(model(src, tgt), before)  # the recording sdpa is removed again
    other = attention_weights(model, [6, 6, 12, 3], tgt[0].tolist())
    assert other["cross"].shape[-1] == 4 and maps["cross"].shape[-1] == 5


@pytest.mark.parametrize("d_k,d_v", [(4, 12), (12, 4)])
def test_unequal_head_widths(d_k, d_v):
    """Table 3 rows A/B pad q/k (or v) to a common head width: the maps are still distributions."""
    maps = attention_weights(_model(d_k=d_k, d_v=d_v), [5, 9, 3], [2, 8, 13])
    for m in maps.values():
        torch.testing.assert_close(m.sum(-1), torch.ones(m.shape[:-1]))


def test_other_threads_using_the_model_meanwhile_change_nothing():
    """The Serve app computes attention while its replica decodes other requests with the same
    model in other threads: their attention calls must neither enter nor disturb the maps."""
    import threading

    model = _model()
    src, tgt = [5, 9, 7, 3], [2, 8, 13]
    want = attention_weights(model, src, tgt)
    stop = threading.Event()

    def busy():
        other = torch.tensor([[6, 6, 12, 11, 4, 3]])
        while not stop.is_set():
            with torch.no_grad():
                model(other, torch.tensor([[2, 9, 9, 10]]))

    threads = [threading.Thread(target=busy) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        for _ in range(30):
            got = attention_weights(model, src, tgt)
            for kind in want:
                torch.testing.assert_close(got[kind], want[kind], rtol=0, atol=0)
    finally:
        stop.set()
        for t in threads:
            t.join()


def test_the_model_carries_no_hook_until_recorded_and_then_one_per_attention():
    """Training runs a model nobody records: its attentions carry no hook. `attention_weights` hooks
    each attention from outside, once, however often it records."""
    model = _model()
    attentions = [m for m in model.modules() if isinstance(m, ScaledDotProductAttention)]
    assert len(attentions) == 2 + 2 * 3 and not any(m._forward_pre_hooks for m in attentions)
    first = attention_weights(model, [5, 9, 3], [2, 8])
    again = attention_weights(model, [5, 9, 3], [2, 8])
    assert [len(m._forward_pre_hooks) for m in attentions] == [1] * 8
    for kind in first:
        torch.testing.assert_close(again[kind], first[kind], rtol=0, atol=0)
