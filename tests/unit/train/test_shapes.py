"""Micro-batches of stable shape (pipeline/batch_plan/shapes.py, `feeder.BatchLayout(buckets=...)`):
the ladder against a hand-made table, the padded batch's step against the unpadded one's (the
same loss and gradients, fp64), the loop with buckets on against off, and the shape count and
padding over base's batch plan on a corpus of WMT14's size (4.5M pairs)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from model import ModelConfig, Transformer
from pipeline.batch_plan.shapes import ShapeBuckets, ladder, real_shape
from pipeline.config import Config
from pipeline.plan import bill
from pipeline.train import feeder
from pipeline.train.corpus import Corpus
from pipeline.train.feeder import BatchLayout, to_device
from pipeline.train.loop import LocalSession, train_worker
from pipeline.train.step import LossSettings, accumulate_gradients
from tests.unit.train.test_loop import shards, tiny_spec  # noqa: F401 (a fixture)


@pytest.mark.parametrize("x,bits,want", [
    (1, 2, 1), (5, 2, 6), (7, 2, 8), (9, 2, 12), (13, 2, 16), (100, 2, 128), (96, 2, 96), (97, 2, 128),
    (8, 4, 8), (17, 4, 18), (31, 4, 32), (33, 4, 36), (1000, 4, 1024), (3001, 4, 3072), (3073, 4, 3328),
    (25001, 4, 26624),
])
def test_ladder_matches_a_hand_made_table(x, bits, want):
    assert ladder(x, bits) == want
    assert bin(want).rstrip("0").count("1") <= bits + 1  # at most `bits` significant bits


def test_bucketed_shape_ties_the_sides_and_fits_the_positions():
    b = ShapeBuckets()
    assert b.shape(B=5, S=13, T=17, Ms=50, Mt=61) == (8, 24, 24, 64, 64)  # hand: 8 rows, W 24, M 61 -> 64
    assert b.shape(B=100, S=30, T=31, Ms=2901, Mt=3001, max_width=0) == (128, 32, 32, 3072, 3072)
    # Near-equal lengths: M rounds past rows x columns, so rows grow (8 x 12 = 96 < 112 = ladder(100)).
    assert b.shape(B=8, S=12, T=12, Ms=96, Mt=96) == (8, 12, 12, 96, 96)
    Bb, W, _, M, _ = b.shape(B=8, S=12, T=12, Ms=97, Mt=97)
    assert M == 104 and Bb * W >= M and Bb == 12
    assert b.shape(B=3, S=300, T=290, Ms=600, Mt=580, max_width=258)[1] == 258  # never past the positions


def _corpus(n: int = 60, seed: int = 0):
    rng = np.random.default_rng(seed)
    src_len, tgt_len = rng.integers(1, 20, n), rng.integers(1, 20, n)
    offsets = lambda lens: np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)  # noqa: E731
    values = lambda lens: rng.integers(4, 50, int(lens.sum())).astype(np.int32)  # noqa: E731
    return values(src_len), offsets(src_len), values(tgt_len), offsets(tgt_len)


def test_bucketed_collate_pads_to_the_shape_and_keeps_the_real_tokens():
    sv, so, tv, to = _corpus()
    rows = np.array([3, 7, 11, 19, 23])
    plain = feeder.collate(rows, Corpus(src_values=sv, src_offsets=so, tgt_values=tv, tgt_offsets=to),
                                  BatchLayout(pad_id=0, bos_id=2, eos_id=3))
    b = feeder.collate(rows, Corpus(src_values=sv, src_offsets=so, tgt_values=tv, tgt_offsets=to),
                              BatchLayout(pad_id=0, bos_id=2, eos_id=3, buckets=ShapeBuckets()))
    want = ShapeBuckets().shape(*real_shape(so[rows + 1] - so[rows], to[rows + 1] - to[rows]))
    assert b.src.shape + b.tgt_in.shape[1:] + (len(b.src_index), len(b.tgt_index)) == want
    B, S, T = len(rows), plain.src.shape[1], plain.tgt_in.shape[1]
    assert np.array_equal(b.src[:B, :S], plain.src) and np.array_equal(b.tgt_out[:B, :T], plain.tgt_out)
    assert (b.src[B:, 0] == 3).all() and (b.src[B:, 1:] == 0).all() and (b.tgt_in[B:, 0] == 2).all()
    assert (b.tgt_out[B:] == 0).all() and (b.src[:B, S:] == 0).all()
    # The real positions come first (as collate's), then pad positions whose target is pad.
    real_t = int((plain.tgt_out != 0).sum())
    assert np.array_equal(b.target[:real_t], plain.tgt_out[plain.tgt_out != 0])
    assert (b.target[real_t:] == 0).all() and len(set(b.tgt_index.tolist())) == len(b.tgt_index)
    assert (b.num_src_tokens, b.num_tgt_tokens) == (plain.num_src_tokens, plain.num_tgt_tokens)


def test_a_bucketed_step_has_the_loss_and_gradients_of_the_unpadded_one():
    torch.manual_seed(0)
    mc = ModelConfig(vocab_size=50, d_model=16, d_ff=32, n_heads=2, n_encoder_layers=2, n_decoder_layers=2,
                     dropout=0.0)
    model = Transformer(mc).double()
    sv, so, tv, to = _corpus()
    rows = np.array([1, 2, 5, 8, 13, 21, 34])
    results = []
    for buckets in (None, ShapeBuckets()):
        b = feeder.collate(rows, Corpus(src_values=sv, src_offsets=so, tgt_values=tv, tgt_offsets=to),
                                  BatchLayout(pad_id=mc.pad_id, bos_id=mc.bos_id, eos_id=mc.eos_id, buckets=buckets))
        model.zero_grad()
        loss, nll = accumulate_gradients(model, [to_device(b, torch.device("cpu"))], b.num_tgt_tokens, 1,
                                         LossSettings(label_smoothing=0.1, pad_id=mc.pad_id))
        results.append((loss, nll, [p.grad.clone() for p in model.parameters()], b.src.shape))
    (l0, n0, g0, s0), (l1, n1, g1, s1) = results
    assert s1[0] > s0[0] and s1[1] > s0[1]  # padded: rows and columns added
    torch.testing.assert_close(l1, l0, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(n1, n0, rtol=1e-12, atol=1e-12)
    for a, b in zip(g0, g1):
        torch.testing.assert_close(b, a, rtol=1e-9, atol=1e-12)
        assert torch.isfinite(b).all()


def test_the_loop_with_buckets_trains_as_without(shards, tmp_path):  # noqa: F811
    def run(name, on):
        spec = tiny_spec(shards, max_steps=6, speed_shape_buckets=on)
        spec["model_config"]["dropout"] = 0.0  # the CPU dropout's mask depends on the tensor's size
        return train_worker(spec, LocalSession(tmp_path / name))
    off, on = run("off", False), run("on", True)
    assert off["batch_shapes"] > on["batch_shapes"] >= 1
    np.testing.assert_allclose([h[1] for h in on["history_train"]], [h[1] for h in off["history_train"]],
                               rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("workers,cap", [(8, 6250), (1, 6250), (1, 50000)])
def test_base_on_a_wmt14_sized_corpus_has_few_shapes_and_little_padding(workers, cap):
    """The bound the buckets are sized for: <= 64 distinct micro-batch shapes per epoch and <= 10% padding for base
    (configs/base.toml: 25k target tokens per step, max_len 256) over 4.5M pairs of the bill's
    assumed lengths; 8 workers of 6250 padded tokens as shipped, or 1 GPU with accumulation or not."""
    cfg = Config()
    cfg.workers.num_workers, cfg.speed.max_tokens_per_batch = workers, cap
    src, tgt = bill.assumed_lengths(cfg, 4_500_000)
    report = bill.shapes_report(cfg, ModelConfig(vocab_size=37000), src, tgt)  # what --plan prints
    assert report.num_shapes <= 64 and report.padding_pct <= 10.0, report.format()
    assert report.num_real_shapes > 100 * report.num_shapes  # what the buckets saved
