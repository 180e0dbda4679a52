"""Beam and greedy search against hand-computed probability tables (fairseq's test style)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from model import ModelConfig, Transformer, beam_search, gnmt_length_penalty, greedy_search

PAD, BOS, EOS, A, B = 0, 2, 3, 4, 5
V = 6
DEFAULT = {EOS: 0.9, A: 0.05, B: 0.05}
TABLES = {
    # Key 10: with alpha = 0 the empty output wins (0.40 > 0.35 * 0.962^4); with alpha = 0.6
    # the length penalty makes [A, A, A, A] win: log(0.35 * 0.962^4) / lp(5) > log(0.4) / lp(1).
    10: {(): {EOS: 0.40, A: 0.35, B: 0.25},
         (A,): {A: 0.962, EOS: 0.019, B: 0.019},
         (A, A): {A: 0.962, EOS: 0.019, B: 0.019},
         (A, A, A): {A: 0.962, EOS: 0.019, B: 0.019},
         (A, A, A, A): {EOS: 0.962, A: 0.019, B: 0.019}},
    # Key 11: greedy takes A, A (0.6 * 0.4 * 0.9 = 0.216); a beam of 2 finds [B] (0.4 * 0.9 = 0.36).
    11: {(): {A: 0.6, B: 0.4},
         (A,): {A: 0.4, B: 0.25, EOS: 0.35}},
    # Key 12: eos is never likely, so outputs run to the length limit.
    12: {"*": {A: 0.9, B: 0.06, EOS: 0.04}},
}


class StubState:
    """A state with neither optional ability of `model.search.SearchState`."""

    first_step_per_sentence = False
    drops_sentences = False

    def __init__(self, keys: list[int], beam_size: int, max_len: int):
        self.keys, self.beam_size, self.max_len, self.step = keys, beam_size, max_len, 0
        self.prefixes: list[tuple[int, ...]] = [()] * len(keys)

    def reorder(self, indices: torch.Tensor, sentences: torch.Tensor | None = None) -> None:
        assert sentences is None, "reorder took sentences from a state that does not drop them"
        idx = indices.tolist()
        assert all(i // self.beam_size == r // self.beam_size for r, i in enumerate(idx))
        self.prefixes = [self.prefixes[i] for i in idx]


class DroppingStubState(StubState):
    """A state that lets beam search drop finished sentences (as `DecoderState` does)."""

    drops_sentences = True

    def reorder(self, indices: torch.Tensor, sentences: torch.Tensor | None = None) -> None:
        if sentences is None:
            return super().reorder(indices)
        kept = sentences.tolist()
        assert kept == sorted(kept) and len(indices) == len(kept) * self.beam_size
        k = self.beam_size
        assert all(i // k == kept[r // k] for r, i in enumerate(indices.tolist())), "a row left its sentence"
        self.prefixes = [self.prefixes[i] for i in indices.tolist()]
        self.keys = [self.keys[i] for i in indices.tolist()]


class StubModel:
    """Next-token distribution looked up by (first source token, output prefix)."""

    cfg = SimpleNamespace(pad_id=PAD, bos_id=BOS, eos_id=EOS, vocab_size=V, max_positions=None)
    state_cls = StubState
    rows_fed = 0

    def encode(self, src_ids):
        return src_ids, src_ids.eq(PAD)

    def init_decoder_state(self, memory, src_pad_mask, beam_size, max_len):
        return self.state_cls([k for k in memory[:, 0].tolist() for _ in range(beam_size)], beam_size, max_len)

    def decode_step(self, prev_ids, state):
        assert state.step < state.max_len, "search fed more tokens than it allocated"
        self.rows_fed += len(prev_ids)
        logits = torch.full((len(state.keys), V), -math.inf)
        for r, tok in enumerate(prev_ids.tolist()):
            if state.step > 0:
                state.prefixes[r] = state.prefixes[r] + (tok,)
            table = TABLES[state.keys[r]]
            probs = table.get("*", table.get(state.prefixes[r], DEFAULT))
            assert sum(probs.values()) == pytest.approx(1.0)
            for t, p in probs.items():
                logits[r, t] = math.log(p)
        state.step += 1
        return logits


def _lp(n: int, alpha: float) -> float:
    return ((5 + n) / 6) ** alpha


def _src(*keys_and_lengths: tuple[int, int]) -> torch.Tensor:
    S = max(n for _, n in keys_and_lengths)
    src = torch.full((len(keys_and_lengths), S), PAD)
    for b, (key, n) in enumerate(keys_and_lengths):
        src[b, : n - 1], src[b, n - 1] = key, EOS
    return src


def test_length_penalty_formula():
    assert gnmt_length_penalty(1, 0.6) == 1.0
    assert gnmt_length_penalty(7, 0.6) == pytest.approx(2.0 ** 0.6)


@pytest.mark.parametrize("alpha, hyp, log_p, n", [
    (0.0, [], math.log(0.40), 1),
    (0.6, [A, A, A, A], math.log(0.35) + 4 * math.log(0.962), 5),
])
def test_length_penalty_changes_the_winner(alpha, hyp, log_p, n):
    hyps, scores = beam_search(StubModel(), _src((10, 2)), beam_size=2, alpha=alpha,
                               max_len_a=0.0, max_len_b=10, return_scores=True)
    assert hyps == [hyp]
    assert scores[0] == pytest.approx(log_p / _lp(n, alpha), rel=1e-6)


@pytest.mark.parametrize("alpha", [0.0, 0.6])
def test_beam_finds_what_greedy_misses(alpha):
    src = _src((11, 3))
    assert greedy_search(StubModel(), src) == [[A, A]]
    hyps, scores = beam_search(StubModel(), src, beam_size=2, alpha=alpha, return_scores=True)
    assert hyps == [[B]]
    assert scores[0] == pytest.approx(math.log(0.4 * 0.9) / _lp(2, alpha), rel=1e-6)


def test_beam_one_equals_greedy_without_length_penalty():
    src = _src((10, 2), (11, 4), (12, 3))
    assert beam_search(StubModel(), src, beam_size=1, alpha=0.0) == greedy_search(StubModel(), src)
    # With alpha > 0 the exact stopping rule lets beam 1 look past greedy's first eos.
    assert greedy_search(StubModel(), _src((10, 2)), max_len_a=0, max_len_b=10) == [[]]
    assert beam_search(StubModel(), _src((10, 2)), beam_size=1, alpha=0.6, max_len_a=0, max_len_b=10) == [[A] * 4]


@pytest.mark.parametrize("beam_size", [1, 2, 3])
@pytest.mark.parametrize("alpha", [0.0, 0.6])
def test_batch_equals_one_at_a_time(beam_size, alpha):
    sentences = [(11, 4), (10, 2), (12, 5), (10, 7)]
    batched = beam_search(StubModel(), _src(*sentences), beam_size=beam_size, alpha=alpha,
                          max_len_b=3, return_scores=True)
    single = [beam_search(StubModel(), _src(s), beam_size=beam_size, alpha=alpha, max_len_b=3,
                          return_scores=True) for s in sentences]
    assert batched[0] == [h[0][0] for h in single]
    assert batched[1] == pytest.approx([h[1][0] for h in single])
    assert greedy_search(StubModel(), _src(*sentences), max_len_b=3) == \
        [greedy_search(StubModel(), _src(s), max_len_b=3)[0] for s in sentences]


class DroppingStubModel(StubModel):
    state_cls = DroppingStubState


@pytest.mark.parametrize("beam_size", [1, 2, 3])
@pytest.mark.parametrize("alpha", [0.0, 0.6])
def test_dropping_finished_sentences_changes_no_result_and_feeds_fewer_rows(beam_size, alpha):
    """Sentences that finish early (keys 11, 10) leave the batch; the long one (key 12) runs on
    alone: the same hypotheses and scores as a state that keeps every sentence to the end."""
    sentences = [(11, 4), (12, 5), (10, 2), (11, 3), (10, 7)]
    kept, dropped = StubModel(), DroppingStubModel()
    full = beam_search(kept, _src(*sentences), beam_size=beam_size, alpha=alpha, max_len_b=6, return_scores=True)
    shrunk = beam_search(dropped, _src(*sentences), beam_size=beam_size, alpha=alpha, max_len_b=6,
                         return_scores=True)
    assert shrunk[0] == full[0]
    assert shrunk[1] == pytest.approx(full[1])
    assert dropped.rows_fed < kept.rows_fed / 2, (dropped.rows_fed, kept.rows_fed)


@pytest.mark.parametrize("a, b", [(1.0, 0), (1.0, 2), (0.5, 1), (0.0, 3), (2.0, 0), (0.7, 0)])
def test_output_never_exceeds_max_length(a, b):
    sentences = [(12, 2), (12, 3), (12, 10), (10, 3)]
    limits = [math.floor(a * n + b) for _, n in sentences]
    for hyps in (beam_search(StubModel(), _src(*sentences), beam_size=2, max_len_a=a, max_len_b=b),
                 greedy_search(StubModel(), _src(*sentences), max_len_a=a, max_len_b=b)):
        assert all(len(h) <= m for h, m in zip(hyps, limits))
        assert [len(h) for h in hyps[:3]] == limits[:3]  # key 12 never wants to stop early


def test_real_model_batch_equals_single_and_restores_train_mode():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=23, d_model=32, d_ff=64, n_heads=4, n_encoder_layers=1,
                      n_decoder_layers=2, max_positions=12)
    model = Transformer(cfg)  # left in train mode: search must switch to eval and back
    src = torch.tensor([[5, 6, 7, 8, 3], [9, 10, 3, 0, 0], [11, 3, 0, 0, 0]])
    batched = beam_search(model, src, beam_size=3, max_len_b=50)
    single = [beam_search(model, src[i : i + 1, : int(src[i].ne(0).sum())], beam_size=3)[0] for i in range(3)]
    assert batched == single and model.training
    assert all(len(h) <= cfg.max_positions - 1 for h in batched)
    assert beam_search(model, src, beam_size=1, alpha=0.0) == greedy_search(model, src)


def _sdpa_switches() -> tuple[bool, bool, bool, bool]:
    b = torch.backends.cuda
    return b.cudnn_sdp_enabled(), b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled(), b.math_sdp_enabled()


def test_gpu_decoding_attention_excludes_cudnn_and_restores_the_switches():
    """A search's shapes change every step, and cuDNN's SDPA plans per shape."""
    from model import search

    before = _sdpa_switches()
    with search.decoding_attention(torch.device("cuda")):
        assert _sdpa_switches() == (False, True, True, True)
    assert _sdpa_switches() == before
    with search.decoding_attention(torch.device("cpu")):
        assert _sdpa_switches() == before  # a CPU keeps PyTorch's choice


@pytest.mark.parametrize("search_fn", ["beam", "greedy"])
def test_searches_decode_inside_the_decoding_attention_context(monkeypatch, search_fn):
    from model import search

    seen: list[bool] = []

    class Recording(StubModel):
        def decode_step(self, prev_ids, state):
            seen.append(torch.backends.cuda.cudnn_sdp_enabled())
            return super().decode_step(prev_ids, state)

    # as on a GPU: these tensors are on the CPU, so the search is told its device is one
    monkeypatch.setattr(search, "decoding_attention", lambda device: search.sdpa_kernel(search.DECODING_BACKENDS))
    run = (lambda m, s: beam_search(m, s, beam_size=2)) if search_fn == "beam" else greedy_search
    assert run(Recording(), _src((11, 3))) in ([[B]], [[A, A]])
    assert seen and not any(seen)
