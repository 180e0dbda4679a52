"""Speed paths against the plain ones: packed (pad-free) encoder/decoder layers, the eval-mode
decode step, the shared first beam-search step, the blocked top-k."""

from __future__ import annotations

import pytest
import torch

from model import ModelConfig, Transformer, beam_search
from model.search import _topk_rows
from model.incremental import DecoderState
from model.compute import Mask, Positions, key_padding_to_attn_mask
from model.transformer import EncoderLayer

PAD, BOS, EOS = 0, 2, 3


def _model(seed: int = 0, dropout: float = 0.1, vocab: int = 23) -> Transformer:
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=vocab, d_model=32, d_ff=64, n_heads=4, n_encoder_layers=2, n_decoder_layers=3,
                      max_positions=40, dropout=dropout)
    return Transformer(cfg).eval()


def _src(vocab: int = 23) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    src = torch.randint(4, vocab, (3, 7), generator=g)
    for b, n in enumerate([7, 4, 2]):
        src[b, n - 1], src[b, n:] = EOS, PAD
    return src


@torch.no_grad()
def test_packed_encoder_layer_equals_padded_at_real_positions():
    torch.manual_seed(0)
    layer = EncoderLayer(ModelConfig(vocab_size=11, d_model=16, d_ff=32, n_heads=4)).eval()
    x = torch.randn(3, 7, 16)
    pad = torch.arange(7)[None, :] >= torch.tensor([7, 4, 1])[:, None]
    at = Positions(~pad)
    padded = layer(x, Mask(keys=key_padding_to_attn_mask(pad)))
    packed = layer(at.pack(x), Mask(keys=key_padding_to_attn_mask(pad), at=at))
    assert packed.shape == (12, 16)
    assert (packed - padded[~pad]).abs().max() < 1e-5
    assert torch.equal(at.unpack(packed)[pad], torch.zeros(int(pad.sum()), 16))


@torch.no_grad()
def test_encode_equals_padded_layers_at_real_positions_and_is_zero_at_padding():
    model = _model()
    src = _src()
    memory, src_pad_mask = model.encode(src)
    x = model.embed(model.src_embed, src)
    for layer in model.encoder_layers:  # the unpacked computation
        x = layer(x, Mask(keys=key_padding_to_attn_mask(src_pad_mask)))
    assert (memory - x)[~src_pad_mask].abs().max() < 1e-5
    assert memory[src_pad_mask].abs().max() == 0


@torch.no_grad()
def test_shared_first_step_equals_feeding_every_beam_through_reorders():
    """Step 0 fed one row per sentence (beam search's first step) leaves every beam's cache as
    feeding all k beams does, and later steps and reorders agree."""
    model = _model(1, dropout=0.0).eval()
    src, k, T = _src(), 3, 6
    memory, src_pad_mask = model.encode(src)
    g = torch.Generator().manual_seed(1)
    rows = torch.randint(4, 23, (3 * k, T), generator=g)
    rows[:, 0] = BOS
    shared = model.init_decoder_state(memory, src_pad_mask, beam_size=k, max_len=T)
    every = model.init_decoder_state(memory, src_pad_mask, beam_size=k, max_len=T)
    every_logits = model.decode_step(rows[:, 0], every)  # (N, V), all k beams fed
    shared_logits = model.decode_step(rows[::k, 0], shared)  # (B, V), one row per sentence
    assert shared_logits.shape == (3, 23)
    assert (shared_logits.repeat_interleave(k, dim=0) - every_logits).abs().max() < 1e-5
    for t in range(1, T):
        perm = (torch.arange(3)[:, None] * k + torch.randint(0, k, (3, k), generator=g)).view(-1)
        shared.reorder(perm), every.reorder(perm)
        assert (model.decode_step(rows[:, t], shared) - model.decode_step(rows[:, t], every)).abs().max() < 1e-5, t


def test_decoding_a_model_in_train_mode_is_refused():
    model = _model(1)
    memory, src_pad_mask = model.eval().encode(_src())
    with pytest.raises(ValueError, match=r"eval mode"):
        model.train().init_decoder_state(memory, src_pad_mask, beam_size=2, max_len=4)


def test_beam_search_shared_first_step_changes_nothing(monkeypatch):
    model = _model(2, vocab=40)
    src = _src(40)
    shared = beam_search(model, src, beam_size=4, max_len_b=8, return_scores=True)
    monkeypatch.setattr(DecoderState, "first_step_per_sentence", False)
    plain = beam_search(model, src, beam_size=4, max_len_b=8, return_scores=True)
    assert shared[0] == plain[0]
    assert max(abs(a - b) for a, b in zip(shared[1], plain[1])) < 1e-5


def test_blocked_topk_equals_topk():
    g = torch.Generator().manual_seed(0)
    for V in (8000, 8003, 700):  # multiple of the block, a remainder, too small (plain topk)
        x = torch.randn(12, V, generator=g)
        values, ids = _topk_rows(x, 10)
        ref_values, ref_ids = x.topk(10, dim=1)
        assert torch.equal(values, ref_values) and torch.equal(ids, ref_ids)
    x = torch.full((2, 8000), -5.0)
    x[0, 7999], x[1, 0] = 1.0, 2.0  # winners in the remainder-free last block and the first
    assert _topk_rows(x, 10)[1][:, 0].tolist() == [7999, 0]


def test_beam_search_dropping_finished_sentences_changes_nothing(monkeypatch):
    """`DecoderState.reorder(indices, sentences)` shrinks every cache to the live sentences: the
    same hypotheses and scores as carrying the finished ones to the end. The budgets differ
    (max_len_a = 1, b = 1: 8, 5 and 3 tokens), so the sentences finish at different steps, and the
    eos row scaled up makes some finish before their budget."""
    model = _model(3, vocab=40)
    with torch.no_grad():
        model.output_proj.weight[EOS] *= 6.0  # tied with the embeddings: eos likelier after some steps
    src = _src(40)
    for alpha in (0.0, 0.6, 1.0):
        dropping = beam_search(model, src, beam_size=4, alpha=alpha, max_len_a=1.0, max_len_b=1, return_scores=True)
        with monkeypatch.context() as m:
            m.setattr(DecoderState, "drops_sentences", False)
            carried = beam_search(model, src, beam_size=4, alpha=alpha, max_len_a=1.0, max_len_b=1,
                                  return_scores=True)
        assert dropping[0] == carried[0], alpha
        assert max(abs(a - b) for a, b in zip(dropping[1], carried[1])) < 1e-5
        lengths = [len(h) for h in dropping[0]]
        assert lengths[0] == 8 and lengths[1] < 5 and lengths[2] < 3, dropping[0]  # two end before their budget
