"""Dev loss and perplexity (pipeline/train/dev_loss.py) against a direct computation.

The reference takes each dev pair alone (no batching, no padding), builds the model's inputs by
hand (source + eos, bos + target, target + eos) and sums PyTorch's own
`F.cross_entropy(label_smoothing=)` and plain cross entropy over every target token; pairs longer
than the model's positions are left out, as DevLoss documents. Two workers are simulated in
this process: each rank's DevLoss takes its stride of the batches, and the all-reduce adds the
two ranks' sums, so the 2-worker figures must equal the direct ones too.
"""

from __future__ import annotations

import contextlib
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from model import ModelConfig, Transformer
from pipeline.batch_plan.shapes import ShapeBuckets
from pipeline.train import dev_loss
from pipeline.train.corpus import Corpus
from pipeline.train.dev_loss import DevLoss
from pipeline.train.step import FusedOutput, LossSettings

EPS = 0.1
VOCAB, MAX_POSITIONS = 40, 24
CPU = torch.device("cpu")


def dev_pairs(n: int = 37, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    rng = np.random.default_rng(seed)
    pairs = [(rng.integers(4, VOCAB, rng.integers(1, 15)).tolist(), rng.integers(4, VOCAB, rng.integers(1, 15)).tolist())
             for _ in range(n)]
    pairs[5] = (pairs[5][0], rng.integers(4, VOCAB, MAX_POSITIONS + 3).tolist())  # too long: left out
    pairs[9] = (rng.integers(4, VOCAB, MAX_POSITIONS).tolist(), pairs[9][1])  # src + eos = 25 > 24: left out
    return pairs


def corpus_of(pairs) -> Corpus:
    def flat(seqs):
        offsets = np.zeros(len(seqs) + 1, dtype=np.int64)
        offsets[1:] = np.cumsum([len(s) for s in seqs])
        return np.array([t for s in seqs for t in s], dtype=np.int32), offsets

    sv, so = flat([p[0] for p in pairs])
    tv, to = flat([p[1] for p in pairs])
    return Corpus(src_values=sv, src_offsets=so, tgt_values=tv, tgt_offsets=to)


@pytest.fixture(scope="module")
def model_and_config():
    torch.manual_seed(0)
    mc = ModelConfig(vocab_size=VOCAB, d_model=32, d_ff=64, n_heads=4, n_encoder_layers=2, n_decoder_layers=2,
                     max_positions=MAX_POSITIONS, dropout=0.3)  # dropout: DevLoss must evaluate
    return Transformer(mc).train(), mc


@torch.no_grad()
def direct(model: Transformer, mc: ModelConfig, pairs) -> dict[str, float]:
    """Each pair alone, in eval mode; sums over target tokens (eos included) / their number."""
    was_training = model.training
    model.eval()
    loss = nll = 0.0
    n = 0
    for src, tgt in pairs:
        if len(src) + 1 > mc.max_positions or len(tgt) + 1 > mc.max_positions:
            continue
        logits = model.logits(model(torch.tensor([src + [mc.eos_id]]), torch.tensor([[mc.bos_id] + tgt])))[0]
        gold = torch.tensor(tgt + [mc.eos_id])
        loss += F.cross_entropy(logits.double(), gold, label_smoothing=EPS, reduction="sum").item()
        nll += F.cross_entropy(logits.double(), gold, reduction="sum").item()
        n += len(gold)
    model.train(was_training)
    return {"val/loss": loss / n, "val/nll": nll / n, "val/ppl": math.exp(nll / n)}


def evaluate(v: DevLoss, model: Transformer) -> dict[str, float] | None:
    """One worker's dev loss: its sums are the whole sums."""
    return DevLoss.metrics(v.sums(model).tolist())


def validator(pairs, mc, rank: int, world: int, max_tokens: int, buckets=None, fused_output=None) -> DevLoss:
    loss = LossSettings(label_smoothing=EPS, pad_id=mc.pad_id, autocast=contextlib.nullcontext,
                        fused_output=fused_output)
    return DevLoss(corpus_of(pairs), mc, max_tokens, loss, rank, world, CPU, buckets)


@pytest.mark.parametrize("max_tokens", [60, 400])  # many small batches with padding; a few wide ones
def test_one_worker_equals_the_direct_computation(model_and_config, max_tokens):
    model, mc = model_and_config
    pairs = dev_pairs()
    v = validator(pairs, mc, 0, 1, max_tokens)
    assert len(v.batches) > 1
    got = evaluate(v, model)
    assert model.training, "the model is put back in training mode"
    want = direct(model, mc, pairs)
    assert got == pytest.approx(want, rel=2e-5)


@pytest.mark.parametrize("gpu", [{"buckets": ShapeBuckets()}, {"fused": True}, {"buckets": ShapeBuckets(), "fused": True}],
                         ids=["buckets", "fused", "both"])
def test_gpu_batches_and_loss_change_no_figure(model_and_config, monkeypatch, gpu):
    """What a GPU worker computes the dev loss with: dev batches padded to the training steps' shape
    buckets, and the fused projection + loss; still the direct computation's figures."""
    model, mc = model_and_config
    pairs = dev_pairs(seed=2)
    shapes = []
    to_device = dev_loss.to_device
    monkeypatch.setattr(dev_loss, "to_device", lambda b, device: shapes.append(b.src.shape + b.tgt_in.shape)
                        or to_device(b, device))
    fused = {"fused_output": FusedOutput(model.output_proj.weight, torch.float32)} if gpu.get("fused") else {}
    v = validator(pairs, mc, 0, 1, 120, buckets=gpu.get("buckets"), **fused)
    got = evaluate(v, model)
    want = direct(model, mc, pairs)
    assert got == pytest.approx(want, rel=2e-5)
    if "buckets" in gpu:  # every batch was padded to a bucketed shape: rows and one width on their ladders
        b = ShapeBuckets()
        for rows, width, rows_t, width_t in shapes:
            assert rows == rows_t and width == width_t
            assert rows == b.shape(rows, 1, 1, 1, 1)[0] and width in (b.shape(8, width, 1, 8, 8)[1], MAX_POSITIONS)
        assert len(set(shapes)) < len(v.batches)  # the dev set's batches share shapes


def test_two_workers_strided_sum_equals_the_direct_computation(model_and_config):
    """Each rank sums its stride of the batches; the metrics of the added sums (what the step's
    agreement adds over the workers) are the whole dev set's."""
    model, mc = model_and_config
    pairs = dev_pairs(seed=1)
    ranks = [validator(pairs, mc, r, 2, 80) for r in (0, 1)]
    assert len(ranks[0].batches) >= 4
    partial = [v.sums(model).tolist() for v in ranks]
    assert partial[0][2] > 0 and partial[1][2] > 0, "both strides hold target tokens"
    got = DevLoss.metrics([a + b for a, b in zip(*partial)])
    want = direct(model, mc, pairs)
    assert got == pytest.approx(want, rel=2e-5)
    # Each stride alone is not the whole dev set: the sum above really needed both.
    assert partial[0][2] + partial[1][2] == sum(len(t) + 1 for s, t in pairs
                                                if len(s) + 1 <= MAX_POSITIONS and len(t) + 1 <= MAX_POSITIONS)