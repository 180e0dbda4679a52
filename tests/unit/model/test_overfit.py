"""End-to-end sanity: a tiny Transformer learns to reverse short sequences (train, greedy, beam)."""

from __future__ import annotations

import pytest
import torch

from model import (ModelConfig, Transformer, beam_search, greedy_search, label_smoothed_nll,
                   make_optimizer, make_scheduler)

PAD, BOS, EOS = 0, 2, 3


def _reverse_task(n: int, vocab_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list]:
    """Source = pieces + [eos]; decoder input = [bos] + reversed pieces; target = reversed + [eos]."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 7, (n,), generator=g).tolist()
    pieces = [torch.randint(4, vocab_size, (k,), generator=g).tolist() for k in lengths]
    S = max(lengths) + 1
    src, tgt_in, tgt_out = (torch.full((n, S), PAD) for _ in range(3))
    for i, p in enumerate(pieces):
        rev = p[::-1]
        src[i, : len(p) + 1] = torch.tensor(p + [EOS])
        tgt_in[i, : len(p) + 1] = torch.tensor([BOS] + rev)
        tgt_out[i, : len(p) + 1] = torch.tensor(rev + [EOS])
    return src, tgt_in, tgt_out, [p[::-1] for p in pieces]


@pytest.mark.slow
def test_tiny_model_learns_to_reverse():
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # more threads spin badly on a busy 2-core box
    torch.set_flush_denormal(True)  # denormals slow CPU training many-fold
    try:
        _train_and_check()
    finally:
        torch.set_num_threads(threads)


def _train_and_check() -> None:
    cfg = ModelConfig(vocab_size=12, d_model=64, d_ff=128, n_heads=4, n_encoder_layers=2,
                      n_decoder_layers=2, dropout=0.0, max_positions=32)
    model = Transformer(cfg)
    opt = make_optimizer(model)
    sched = make_scheduler(opt, d_model=cfg.d_model, warmup_steps=50, scale=0.5)
    src, tgt_in, tgt_out, expected = _reverse_task(64, cfg.vocab_size, seed=1)
    for _ in range(250):  # ~5 s on one CPU thread; the loss floor (~0.53) is reached by ~200
        loss, _ = label_smoothed_nll(model.logits(model(src, tgt_in)), tgt_out, epsilon=0.1, reduction="mean")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    model.eval()
    greedy = greedy_search(model, src, max_len_a=1.0, max_len_b=5)
    beam = beam_search(model, src, beam_size=4, alpha=0.6, max_len_a=1.0, max_len_b=5)
    greedy_acc = sum(h == e for h, e in zip(greedy, expected)) / len(expected)
    beam_acc = sum(h == e for h, e in zip(beam, expected)) / len(expected)
    assert greedy_acc >= 0.95 and beam_acc >= 0.95, (loss.item(), greedy_acc, beam_acc)
