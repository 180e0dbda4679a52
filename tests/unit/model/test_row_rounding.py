"""Rounded rows (`feeder.BatchLayout(row_multiple=)`, what CPU bf16 training uses): the extra pad
positions change nothing the step computes. Reference: the same model on unrounded rows, and its
full (B, T, V) logits at the real positions."""

from __future__ import annotations

import numpy as np
import torch

from model import ModelConfig, NonPad, Transformer, label_smoothed_nll
from pipeline.train import feeder
from pipeline.train.corpus import Corpus
from pipeline.train.feeder import BatchLayout, to_device


def test_loss_and_gradients_with_rounded_rows_equal_the_unrounded_ones():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=40, d_model=32, d_ff=64, n_heads=4, n_encoder_layers=2,
                                    n_decoder_layers=2, dropout=0.0, max_positions=64)).double()
    rng = np.random.default_rng(0)
    src_lens, tgt_lens = rng.integers(1, 12, size=7), rng.integers(1, 12, size=7)
    sv, tv = rng.integers(4, 40, size=int(src_lens.sum())), rng.integers(4, 40, size=int(tgt_lens.sum()))
    so, to = np.concatenate([[0], np.cumsum(src_lens)]), np.concatenate([[0], np.cumsum(tgt_lens)])

    def loss_and_grads(multiple: int):
        b = to_device(feeder.collate(np.arange(7),
                                            Corpus(src_values=sv, src_offsets=so, tgt_values=tv, tgt_offsets=to),
                                            BatchLayout(pad_id=0, bos_id=2, eos_id=3, row_multiple=multiple)),
                      torch.device("cpu"))
        model.zero_grad()
        logits = model.logits(model(b.src, b.tgt_in, NonPad(b.src_index, b.tgt_index)))
        loss, nll = label_smoothed_nll(logits, b.target, epsilon=0.1, ignore_index=0)
        loss.backward()
        return len(b.tgt_index), loss.item(), nll.item(), [p.grad.clone() for p in model.parameters()]

    m1, loss1, nll1, g1 = loss_and_grads(1)
    m64, loss64, nll64, g64 = loss_and_grads(64)
    assert m1 % 64 != 0 and m64 % 64 == 0  # the rounding happened
    assert abs(loss64 - loss1) < 1e-9 * abs(loss1) and abs(nll64 - nll1) < 1e-9 * abs(nll1)
    for a, b in zip(g1, g64):
        torch.testing.assert_close(b, a, rtol=1e-9, atol=1e-12)

    b = feeder.collate(np.arange(7), Corpus(src_values=sv, src_offsets=so, tgt_values=tv, tgt_offsets=to),
                              BatchLayout(pad_id=0, bos_id=2, eos_id=3))  # reference: full logits, pad ignored
    full = model.logits(model(torch.from_numpy(b.src), torch.from_numpy(b.tgt_in)))
    ref, _ = label_smoothed_nll(full.reshape(-1, 40), torch.from_numpy(b.tgt_out).reshape(-1), epsilon=0.1,
                                ignore_index=0)
    assert abs(ref.item() - loss64) < 1e-9 * abs(ref.item())
