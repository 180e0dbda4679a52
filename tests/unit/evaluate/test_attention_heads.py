"""pipeline.decoding.attention_heads on hand-built attention patterns (each must get its label, the
measures are checked against hand-computed values), and pipeline.decoding.positional_view against
the model's own embedding and the closed form of the sinusoids' dot products."""

from __future__ import annotations

import math

import pytest
import torch

from model import ModelConfig, Transformer
from pipeline.decoding.attention_heads import head_characters, head_label, head_measures
from pipeline.decoding.positional_view import positional_view

L = 6


def _one_hot_rows(columns: list[int], n_keys: int = L) -> torch.Tensor:
    """(len(columns), n_keys): row i puts all its weight on key columns[i]."""
    return torch.nn.functional.one_hot(torch.tensor(columns), n_keys).float()


PATTERNS = {  # name -> (kind, weights, the label)
    "diagonal": ("encoder_self", _one_hot_rows(list(range(L))), "mostly attends to the same piece: 100%"),
    "previous": ("decoder_self", _one_hot_rows([0] + list(range(L - 1))), "mostly attends to the previous piece: 100%"),
    "next": ("encoder_self", _one_hot_rows(list(range(1, L)) + [L - 1]), "mostly attends to the next piece: 100%"),
    "first": ("encoder_self", _one_hot_rows([0] * L), "mostly attends to the first piece: 100%"),
    "last": ("cross", _one_hot_rows([L - 1] * 4), "mostly attends to the last piece: 100%"),
    "one source piece": ("cross", _one_hot_rows([2, 2, 2, 3]), 'mostly attends to the piece "c" at position 2: 75%'),
    "monotone": ("cross", torch.tensor([[.4, .35, .25, 0, 0, 0], [0, .4, .35, .25, 0, 0], [0, 0, .4, .35, .25, 0],
                                        [0, 0, 0, .4, .35, .25]]),
                 "follows the source in order: 100% of steps move forward or stay, over 67% of it"),
    "stuck": ("cross", torch.tensor([[.1, .3, .2, .2, .1, .1]] * 5), 'spreads its weight: at most 30% on the piece "b"'
                                                                     " at position 1"),
    "uniform": ("encoder_self", torch.full((L, L), 1 / L),
                f"spreads its weight: at most {1 / L:.0%} on the same piece"),
}


@pytest.mark.parametrize("name", PATTERNS)
def test_each_hand_built_pattern_gets_its_label(name):
    kind, w, label = PATTERNS[name]
    got = head_characters(w[None], kind, key_pieces=list("abcdef"))
    assert got[0]["label"] == label, got[0]


def test_measures_by_hand():
    """previous-token head of a decoder: previous 1 (rows 1..5), same 1/6 (row 0), first 2/6 (rows 0, 1)."""
    m = head_measures(_one_hot_rows([0] + list(range(L - 1))), "decoder_self")
    assert m["previous"] == 1 and m["same"] == pytest.approx(1 / 6) and m["first"] == pytest.approx(2 / 6)
    assert m["next"] == 0 and m["last"] is None and m["monotone"] is None and m["coverage"] is None
    assert m["entropy"] == 0
    cross = head_measures(torch.tensor([[.5, .5, 0], [0, 0, 1.], [1., 0, 0]]), "cross")
    assert cross["same"] is None and cross["previous"] is None and cross["next"] is None
    assert cross["monotone"] == 0.5  # argmax 0 -> 2 forward, 2 -> 0 back
    assert cross["coverage"] == pytest.approx(2 / 3)  # argmax on columns 0 and 2
    assert cross["entropy"] == pytest.approx(math.log(2) / 3)
    assert cross["top_key"] == {"index": 0, "piece": None, "share": pytest.approx(0.5)}
    assert cross["last"] == pytest.approx(1 / 3)


def test_a_label_reports_the_largest_measure_and_its_share():
    w = torch.tensor([[.71, .29, 0], [.29, .71, 0], [.05, .24, .71]])  # 71% on the same piece
    assert head_label(head_measures(w, "encoder_self")) == "mostly attends to the same piece: 71%"


def _model(**kw) -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig(vocab_size=50, d_model=32, d_ff=64, n_heads=4, n_encoder_layers=1,
                                   n_decoder_layers=1, max_positions=64, **kw)).eval()


@pytest.mark.parametrize("positional", ["sinusoid", "learned"])
def test_positional_view_is_what_the_model_adds(positional):
    """table = the model's embedded input minus its scaled token embedding; norms of both; dots = table table^T."""
    model = _model(positional=positional)
    src = [5, 9, 11, 7, 3]
    view = positional_view(model, src)
    with torch.no_grad():
        embedded = model.embed(model.src_embed, torch.tensor([src]))[0]
        tokens = model.src_embed(torch.tensor(src)) * math.sqrt(32)
    table = torch.tensor(view["table"])
    torch.testing.assert_close(table, embedded - tokens, rtol=0, atol=1e-5)
    torch.testing.assert_close(torch.tensor(view["dots"]), table @ table.T, rtol=0, atol=1e-5)
    torch.testing.assert_close(torch.tensor(view["embedding_norms"]), tokens.norm(dim=-1), rtol=0, atol=1e-5)
    torch.testing.assert_close(torch.tensor(view["pe_norms"]), table.norm(dim=-1), rtol=0, atol=1e-5)


def test_sinusoid_dots_depend_on_the_offset_only():
    """§3.5: PE(i).PE(j) = sum_k cos(w_k (i - j)), w_k = 10000^(-2k/d); every row's norm is sqrt(d/2)."""
    view = positional_view(_model(), list(range(4, 14)))
    d = 32
    freqs = [10000 ** (-2 * k / d) for k in range(d // 2)]
    for i in range(10):
        assert view["pe_norms"][i] == pytest.approx(math.sqrt(d / 2), rel=1e-6)
        for j in range(10):
            assert view["dots"][i][j] == pytest.approx(sum(math.cos(w * (i - j)) for w in freqs), abs=1e-4)
