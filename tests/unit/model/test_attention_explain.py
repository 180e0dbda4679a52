"""pipeline.decoding.attention_explain: one head's row, checked against the model itself: the maps
of `attention_weights` (exactly), the model's own projections and attention output read through
hooks on its modules (q, k, v, the output before W_O, W_O's output), and softmax recomputed by torch."""

from __future__ import annotations

import math

import pytest
import torch

from model import ModelConfig, Transformer
from model.attention_weights import KINDS, attention_weights, record_attention
from pipeline.decoding.attention_explain import attention_module, explain_problem, explain_row

CFG = dict(vocab_size=50, d_model=32, d_ff=64, n_heads=4, n_encoder_layers=2, n_decoder_layers=2, dropout=0.1,
           max_positions=64)
SRC, TGT = [5, 9, 11, 7, 3], [2, 8, 13, 21]


def _model(**kw) -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig(**{**CFG, **kw})).eval()


def _rows(kind: str) -> int:
    return len(SRC) if kind == "encoder_self" else len(TGT)


def _hooked_pass(model: Transformer, kind: str, layer: int) -> dict[str, torch.Tensor]:
    """The block's projections and W_O's input and output in one plain forward pass, as (positions, width);
    copied, as the model adds the residual into W_O's output in place."""
    module, seen = attention_module(model, kind, layer), {}

    def keep(name):
        return lambda mod, args, out: seen.__setitem__(name, out.detach().clone().reshape(-1, out.shape[-1]))

    hooks = [module.out_proj.register_forward_pre_hook(
                 lambda mod, args: seen.__setitem__("before_w_o", args[0].detach().reshape(-1, args[0].shape[-1]))),
             module.out_proj.register_forward_hook(keep("w_o"))]
    for name in ("qkv_proj", "q_proj", "kv_proj"):
        if hasattr(module, name):
            hooks.append(getattr(module, name).register_forward_hook(keep(name)))
    try:
        with torch.no_grad():
            model(torch.tensor([SRC]), torch.tensor([TGT]))
    finally:
        for h in hooks:
            h.remove()
    return seen


def _projections(model: Transformer, kind: str, seen: dict[str, torch.Tensor], head: int):
    """This head's q (Lq, d_k), k (Lk, d_k), v (Lk, d_v) from the projections' outputs: the fused
    rows are [W_Q; W_K; W_V] (self) or W_Q and [W_K; W_V] (cross), each h blocks of one head's width."""
    cfg = model.cfg
    d_k = cfg.d_k or cfg.d_model // cfg.n_heads
    d_v = cfg.d_v or cfg.d_model // cfg.n_heads
    h = cfg.n_heads
    if kind == "cross":
        q, kv = seen["q_proj"], seen["kv_proj"]
        k, v = kv[:, : h * d_k], kv[:, h * d_k:]
    else:
        qkv = seen["qkv_proj"]
        q, k, v = qkv[:, : h * d_k], qkv[:, h * d_k: 2 * h * d_k], qkv[:, 2 * h * d_k:]
    return (q[:, head * d_k:(head + 1) * d_k], k[:, head * d_k:(head + 1) * d_k], v[:, head * d_v:(head + 1) * d_v],
            d_k, d_v)


def _explain(model: Transformer, kind: str, layer: int, head: int, query: int) -> dict:
    call = record_attention(model, SRC, TGT)[kind][layer]
    return explain_row(attention_module(model, kind, layer), call, head, query)


@pytest.mark.parametrize("kind", KINDS)
def test_weights_are_the_maps_rows_exactly(kind):
    model = _model()
    maps = attention_weights(model, SRC, TGT)
    for layer in range(2):
        for head in range(CFG["n_heads"]):
            for query in range(_rows(kind)):
                got = _explain(model, kind, layer, head, query)["weights"]
                assert got == maps[kind][layer, head, query].tolist(), (kind, layer, head, query)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("widths", [{}, {"d_k": 4, "d_v": 12}, {"d_k": 12, "d_v": 4}])
def test_every_step_against_the_models_own_modules(kind, widths):
    """q, keys and values = the projections' outputs; scores = q.k; scaled = q.k / sqrt(d_k); weights
    = torch's softmax of the masked scaled scores (1e-6); output = the model's attention output
    before W_O (hook, 1e-5); the contribution = W_O's columns of this head times it."""
    model = _model(**widths)
    layer, query = 1, _rows(kind) - 2
    for head in range(CFG["n_heads"]):
        seen = _hooked_pass(model, kind, layer)
        q, k, v, d_k, d_v = _projections(model, kind, seen, head)
        e = _explain(model, kind, layer, head, query)
        assert (e["d_k"], e["d_v"], len(e["q"]), len(e["values"][0])) == (d_k, d_v, d_k, d_v)
        torch.testing.assert_close(torch.tensor(e["q"]), q[query], rtol=0, atol=1e-6)
        torch.testing.assert_close(torch.tensor(e["keys"]), k, rtol=0, atol=1e-6)
        torch.testing.assert_close(torch.tensor(e["values"]), v, rtol=0, atol=1e-6)
        allowed = torch.tensor(e["mask"])
        want_mask = torch.arange(len(allowed)) <= query if kind == "decoder_self" else torch.ones_like(allowed)
        assert torch.equal(allowed, want_mask)
        dots = k @ q[query]
        assert all((s is None) == (not a) for s, a in zip(e["scores"], e["mask"]))
        torch.testing.assert_close(torch.tensor([s for s in e["scores"] if s is not None]), dots[allowed],
                                   rtol=0, atol=1e-5)
        assert e["scale"] == pytest.approx(1 / math.sqrt(d_k))
        scaled = torch.tensor([-math.inf if s is None else s for s in e["scaled"]])
        torch.testing.assert_close(scaled[allowed], dots[allowed] / math.sqrt(d_k), rtol=0, atol=1e-5)
        torch.testing.assert_close(torch.tensor(e["weights"]), torch.softmax(scaled, -1), rtol=0, atol=1e-6)
        unscaled = torch.tensor([-math.inf if s is None else s for s in e["scores"]])
        torch.testing.assert_close(torch.tensor(e["weights_unscaled"]), torch.softmax(unscaled, -1), rtol=0, atol=1e-6)
        assert all(w == 0 for w, a in zip(e["weights"], e["mask"]) if not a)
        before_w_o = seen["before_w_o"][query, head * d_v:(head + 1) * d_v]
        torch.testing.assert_close(torch.tensor(e["output"]), before_w_o, rtol=0, atol=1e-5)
        w_o = model_w_o(model, kind, layer)[:, head * d_v:(head + 1) * d_v]
        torch.testing.assert_close(torch.tensor(e["w_o"]["contribution"]), w_o @ before_w_o, rtol=0, atol=1e-5)


def model_w_o(model: Transformer, kind: str, layer: int) -> torch.Tensor:
    return attention_module(model, kind, layer).out_proj.weight.detach()


@pytest.mark.parametrize("kind", KINDS)
def test_head_contributions_add_up_to_w_o_output_and_shares_to_one(kind):
    """sum over heads of the contributions + W_O's bias = W_O's output in the model (hook)."""
    model = _model()
    layer, query = 0, 1
    seen = _hooked_pass(model, kind, layer)
    rows = [_explain(model, kind, layer, head, query) for head in range(CFG["n_heads"])]
    total = sum(torch.tensor(r["w_o"]["contribution"]) for r in rows)
    bias = attention_module(model, kind, layer).out_proj.bias.detach()
    torch.testing.assert_close(total + bias, seen["w_o"][query], rtol=0, atol=1e-5)
    assert sum(r["w_o"]["share"] for r in rows) == pytest.approx(1.0)
    for r in rows:
        assert r["w_o"]["norm"] == pytest.approx(float(torch.tensor(r["w_o"]["contribution"]).norm()), rel=1e-6)


def _entropy(w: list[float]) -> float:
    return -sum(x * math.log(x) for x in w if x > 0)


def test_unscaled_weights_are_more_peaked_on_every_row():
    """softmax(beta s) loses entropy as beta grows (its derivative is -beta Var(s) <= 0), so leaving
    out 1/sqrt(d_k) (beta 1 instead of d_k^-0.5) gives every row with two or more distinct
    allowed scores a lower entropy, whatever the weights (trained: tests/integration/test_serve.py)."""
    model = _model()
    for kind in KINDS:
        for query in range(_rows(kind)):
            for head in range(CFG["n_heads"]):
                e = _explain(model, kind, 1, head, query)
                assert e["entropy"]["scaled"] == pytest.approx(_entropy(e["weights"]), abs=1e-5)
                assert e["entropy"]["unscaled"] == pytest.approx(_entropy(e["weights_unscaled"]), abs=1e-5)
                if sum(e["mask"]) > 1:
                    assert e["entropy"]["unscaled"] < e["entropy"]["scaled"], (kind, query, head)
                else:  # the decoder's first query sees one key: one-hot either way
                    assert e["entropy"]["unscaled"] == e["entropy"]["scaled"] == 0


@pytest.mark.parametrize("ask, words", [
    (("cross_self", 0, 0, 0), '"kind" must be one of encoder_self, decoder_self, cross'),
    (("cross", 2, 0, 0), '"layer" 2 is out of range: there are 2 the model\'s cross layers'),
    (("encoder_self", 0, 4, 0), '"head" 4 is out of range: there are 4 heads, numbered 0 to 3'),
    (("decoder_self", 0, 0, 4), '"query" 4 is out of range: there are 4 query positions'),
    (("cross", 0, -1, 0), '"head" -1 is out of range'),
    (("cross", 0, 1.0, 0), '"head" must be an integer; got 1.0'),
    (("cross", True, 0, 0), '"layer" must be an integer; got True'),
])
def test_each_bad_index_is_named(ask, words):
    problem = explain_problem(_model().cfg, *ask, n_queries=4)
    assert problem is not None and words in problem, problem
    assert explain_problem(_model().cfg, "cross", 1, 3, 3, n_queries=4) is None


@pytest.fixture(scope="module")
def sp(tmp_path_factory):
    """A real SentencePiece model, trained on a few sentences (ids: pad 0, unk 1, bos 2, eos 3, as ours)."""
    import sentencepiece as spm

    prefix = tmp_path_factory.mktemp("spm") / "spm"
    words = "the a dog cat runs sleeps on red green grass mat der die das hund katze läuft schläft auf gras".split()
    lines = [" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(6)) for i in range(200)]
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_prefix=str(prefix), vocab_size=45,
                                   model_type="bpe", pad_id=0, unk_id=1, bos_id=2, eos_id=3, minloglevel=2)
    return spm.SentencePieceProcessor(model_file=f"{prefix}.model")


def test_explain_attention_names_positions_as_the_maps_do(sp):
    from pipeline.decoding.attention_explain import explain_attention
    from pipeline.decoding.attention_maps import translation_attention

    model = _model()
    src = sp.encode("the dog sleeps on the mat")
    hypothesis = "der hund schläft"
    att = translation_attention(model, sp, src, hypothesis)
    for kind, keys, queries in (("encoder_self", att.src_pieces, att.src_pieces),
                                ("decoder_self", att.tgt_pieces, att.tgt_pieces),
                                ("cross", att.src_pieces, att.tgt_pieces)):
        query = len(queries) - 1
        e = explain_attention(model, sp, src, hypothesis, kind, 1, 3, query)
        assert (e["kind"], e["layer"], e["head"], e["query"]) == (kind, 1, 3, query)
        assert e["query_piece"] == queries[query] and e["key_pieces"] == keys
        assert e["weights"] == att.maps[kind][1, 3, query].tolist()
        with pytest.raises(ValueError, match=f'"query" {query + 1} is out of range'):
            explain_attention(model, sp, src, hypothesis, kind, 1, 3, query + 1)
