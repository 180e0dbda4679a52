"""Incremental decoding equals the teacher-forced forward; causality; padding invariance."""

from __future__ import annotations

import torch

from model import ModelConfig, NonPad, Transformer

PAD, BOS, EOS = 0, 2, 3


def _model(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=23, d_model=32, d_ff=64, n_heads=4, n_encoder_layers=2,
                      n_decoder_layers=2, max_positions=40)
    return Transformer(cfg).eval()


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    src = torch.randint(4, 23, (3, 7), generator=g)
    for b, n in enumerate([7, 4, 2]):  # different source lengths: pieces + eos, then pad
        src[b, n - 1], src[b, n:] = EOS, PAD
    tgt_in = torch.randint(4, 23, (3, 6), generator=g)
    tgt_in[:, 0] = BOS
    tgt_in[1, 4:] = PAD
    tgt_in[2, 2:] = PAD
    return src, tgt_in


@torch.no_grad()
def test_decode_step_equals_forward_at_every_position():
    model = _model()
    src, tgt_in = _batch()
    full = model.logits(model(src, tgt_in))  # (B, T, V)
    memory, src_pad_mask = model.encode(src)
    state = model.init_decoder_state(memory, src_pad_mask, beam_size=1, max_len=tgt_in.shape[1])
    for t in range(tgt_in.shape[1]):
        step_logits = model.decode_step(tgt_in[:, t], state)  # (B, V)
        assert (step_logits - full[:, t]).abs().max() < 1e-5, t
    assert state.step == tgt_in.shape[1]


@torch.no_grad()
def test_decode_step_with_beams_and_reorder():
    """Beams share the memory; after reorder each row continues the chosen row's prefix."""
    model = _model(1)
    src, tgt_in = _batch()
    k, T = 2, tgt_in.shape[1]
    rows = tgt_in.repeat_interleave(k, dim=0)  # (B*k, T)
    rows[1::2, 1:3] = torch.tensor([5, 6])  # beam 1 of each sentence starts differently
    memory, src_pad_mask = model.encode(src)
    state = model.init_decoder_state(memory, src_pad_mask, beam_size=k, max_len=T)
    for t in range(3):
        model.decode_step(rows[:, t], state)
    swap = torch.arange(len(rows)).view(-1, k).flip(1).reshape(-1)  # swap beams within sentences
    state.reorder(swap)
    prefixes = rows.clone()
    prefixes[:, :3] = rows[swap, :3]
    for t in range(3, T):
        step_logits = model.decode_step(prefixes[:, t], state)
        expected = model.logits(model(src.repeat_interleave(k, dim=0), prefixes))[:, t]
        assert (step_logits - expected).abs().max() < 1e-5, t


@torch.no_grad()
def test_causality_future_tokens_do_not_change_earlier_logits():
    model = _model(2)
    src, tgt_in = _batch()
    base = model.logits(model(src, tgt_in))
    for j in range(1, tgt_in.shape[1]):
        changed = tgt_in.clone()
        changed[:, j] = (changed[:, j] + 1 - 4) % 19 + 4
        out = model.logits(model(src, changed))
        assert torch.equal(out[:, :j], base[:, :j]) or (out[:, :j] - base[:, :j]).abs().max() < 1e-6
        assert (out[:, j] - base[:, j]).abs().max() > 1e-4


@torch.no_grad()
def test_extra_padding_changes_nothing():
    model = _model(3)
    src, tgt_in = _batch()
    pad_src = torch.cat([src, torch.full((3, 4), PAD)], dim=1)
    pad_tgt = torch.cat([tgt_in, torch.full((3, 2), PAD)], dim=1)
    assert (model.logits(model(pad_src, pad_tgt))[:, : tgt_in.shape[1]] - model.logits(model(src, tgt_in))).abs().max() < 1e-5


def test_dropout_only_in_train_mode():
    model = _model(4)
    src, tgt_in = _batch()
    with torch.no_grad():
        assert torch.equal(model(src, tgt_in), model(src, tgt_in))
        model.train()
        assert not torch.equal(model(src, tgt_in), model(src, tgt_in))


@torch.no_grad()
def test_forward_at_nonpad_positions_selects_real_positions():
    model = _model(5)
    src, tgt_in = _batch()
    full = model.logits(model(src, tgt_in))
    packed = model.logits(model(src, tgt_in, NonPad()))
    keep = tgt_in.ne(PAD)
    assert packed.shape == (int(keep.sum()), 23)
    assert (packed - full[keep]).abs().max() < 1e-5
