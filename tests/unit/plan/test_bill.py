"""The train stage's bill (pipeline/plan/bill.py, pipeline/plan/flops.py): torch's FLOP counter
on the real model against matmul and attention FLOPs by formula for a tiny model; the printed
hours against the formula from the bill's own printed inputs; the MFU from a gpu_check JSON;
--plan's bill from a cached encode stage; the same figures as the train run's MLflow params."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import numpy as np
import pytest

from model import ModelConfig
from pipeline.config import ConfigError, load_config
from pipeline.stage import Manifest
from pipeline.plan import bill
from pipeline.plan import flops
from pipeline.plan.flops import MicroShape, count_step_flops, six_n_t, step_flops
from pipeline.train.corpus import load_lengths
from pipeline.train.driver import _log_bill
from tests.support.synthetic import write_reverse_task
from workflows.runner import format_bill, make_plan

TINY = ModelConfig(vocab_size=50, d_model=16, d_ff=32, n_heads=2, n_encoder_layers=2, n_decoder_layers=1, dropout=0.1)


def by_formula(mc: ModelConfig, shapes: list[MicroShape]) -> int:
    """Forward + backward FLOPs by hand: a (rows x i) @ (i x o) matmul is 2·rows·i·o forward and
    twice that backward (the input's and the weight's gradients); attention (QK^T and AV) is
    2 matmuls of 2·B·h·Tq·Tk·hd each, on the padded shapes, also 3x for forward + backward."""
    d, f, V, h = mc.d_model, mc.d_ff, mc.vocab_size, mc.n_heads
    lin = lambda rows, i, o: 6 * rows * i * o  # noqa: E731
    att = lambda B, tq, tk: 3 * 2 * (2 * B * h * tq * tk * (d // h))  # noqa: E731
    total = 0
    for m in shapes:
        enc = lin(m.Ms, d, 3 * d) + lin(m.Ms, d, d) + lin(m.Ms, d, f) + lin(m.Ms, f, d) + att(m.B, m.S, m.S)
        dec = (lin(m.Mt, d, 3 * d) + lin(m.Mt, d, d) + att(m.B, m.T, m.T)  # masked self-attention
               + lin(m.Mt, d, d) + lin(m.Ms, d, 2 * d) + lin(m.Mt, d, d) + att(m.B, m.T, m.S)  # cross: q, kv, o
               + lin(m.Mt, d, f) + lin(m.Mt, f, d))
        total += mc.n_encoder_layers * enc + mc.n_decoder_layers * dec + lin(m.Mt, d, V)  # + output projection
    return total


def test_flop_counter_matches_the_hand_count_for_a_tiny_model():
    shapes = [MicroShape.of(np.array([3, 5]), np.array([4, 2])), MicroShape.of(np.array([7]), np.array([9])),
              MicroShape.of(np.array([1, 2, 3, 4]), np.array([6, 5, 4, 3]))]
    assert shapes[0] == MicroShape(B=2, S=6, T=5, Ms=10, Mt=8)
    assert count_step_flops(TINY, shapes) == by_formula(TINY, shapes)
    assert count_step_flops(TINY, shapes[:1]) + count_step_flops(TINY, shapes[1:]) == by_formula(TINY, shapes)


def _random_shapes(rng: np.random.Generator, n: int) -> list[MicroShape]:
    return [MicroShape.of(rng.integers(1, 40, size=b), rng.integers(1, 40, size=b)) for b in rng.integers(1, 9, size=n)]


def test_step_flops_equals_the_hand_count_on_every_micro_batch():
    """The bill's `step_flops` (the counter run on six probes, then a linear form) against the
    hand count (`by_formula`, itself checked against the counter above) on 20 random micro-batches."""
    shapes = _random_shapes(np.random.default_rng(1), 20)
    assert [step_flops(TINY, [m], 0.1) for m in shapes] == [by_formula(TINY, [m]) for m in shapes]
    assert step_flops(TINY, shapes, 0.1) == by_formula(TINY, shapes)


def test_step_flops_equals_the_counter_for_other_head_widths_and_learned_positions():
    mc = ModelConfig(vocab_size=70, d_model=24, d_ff=40, n_heads=3, n_encoder_layers=1, n_decoder_layers=2,
                     d_k=4, d_v=12, positional="learned")
    shapes = _random_shapes(np.random.default_rng(3), 3)
    assert step_flops(mc, shapes, 0.1) == count_step_flops(mc, shapes, 0.1)


def test_step_flops_falls_back_to_the_counter_when_the_form_does_not_hold(monkeypatch):
    """A form missing a term (here: the cross-attention's B·T·S) fails the check on the sixth
    probe; the figure is then the counter's own, not a wrong fit."""
    monkeypatch.setattr(flops, "_forms", {})
    monkeypatch.setattr(flops, "_monomials", lambda m: (m.Ms, m.Mt, m.B * m.S * m.S, m.B * m.T * m.T, m.B))
    calls = []
    real = flops.count_step_flops
    monkeypatch.setattr(flops, "count_step_flops", lambda *a: calls.append(len(a[1])) or real(*a))
    shapes = _random_shapes(np.random.default_rng(2), 2)
    assert flops._linear_form(TINY, 0.1) is None
    assert step_flops(TINY, shapes, 0.1) == by_formula(TINY, shapes)
    assert calls[-1] == len(shapes)  # counted directly


def _number(text: str, pattern: str) -> float:
    m = re.search(pattern, text)
    assert m, (pattern, text)
    return float(m.group(1).replace(",", ""))


def test_the_printed_hours_follow_from_the_printed_inputs():
    cfg = load_config(None, ["--workers.num_workers=8", "--plan.gpu_type=H100", "--plan.assumed_mfu=0.25",
                             "--train.max_steps=1000", "--train.tokens_per_step=3000", "--speed.max_tokens_per_batch=2000",
                             "--model.d_model=64", "--model.d_ff=128", "--model.n_heads=2", "--vocab.size=500"])
    mc = ModelConfig(vocab_size=500, d_model=64, d_ff=128, n_heads=2)
    text = bill.make_bill(cfg, mc).format()
    steps = _number(text, r"to train.max_steps = (\d+)")
    gpus = _number(text, r"bill of the train stage: (\d+) x H100")
    flops = _number(text, r"FLOPs per step +([0-9.e+-]+) counted")
    peak = _number(text, r"peak +([0-9.e+-]+) FLOP/s")
    mfu = _number(text, r"MFU +([0-9.]+) =")
    hours = _number(text, r"= ([0-9.e+-]+) h\n")
    gpu_hours = _number(text, r"GPU-hours +GPUs x hours = ([0-9.e+-]+)")
    assert (steps, gpus, peak, mfu) == (1000, 8, 989e12, 0.25)
    assert hours == pytest.approx(steps * flops / (gpus * peak * mfu) / 3600, rel=1e-3)
    assert gpu_hours == pytest.approx(gpus * hours, rel=1e-3)
    assert "ASSUMPTION" in text and "assumed lengths" in text
    n = int(_number(text, r"parameters +([0-9,]+) "))
    tgt = _number(text, r"T = ([0-9,]+) target tokens")
    assert _number(text, r"\n +([0-9.e+-]+) by 6\*N\*T") == pytest.approx(six_n_t(n, tgt), rel=1e-3)
    assert 2000 <= tgt <= 3000 + 130  # a step closes once it holds tokens_per_step target tokens


def gpu_check_json(tmp_path, **row) -> str:
    path = tmp_path / "gpu_check.json"
    sections = {"train base eager": {"status": "ok", "mfu_pct": 20.0, "mfu_counted_pct": 24.0, **row},
                "train base compiled": {"status": "failed"}}
    path.write_text(json.dumps({"env": {"device": "NVIDIA H200"}, "smoke": False, "sections": sections}))
    return str(path)


def test_mfu_from_a_gpu_check_json(tmp_path):
    base = ModelConfig.base(37000)
    mfu, source, notes = bill.mfu_from_gpu_check(gpu_check_json(tmp_path), base, compiled=True, gpu_type="H200")
    assert mfu == 0.24 and "measured: gpu_check 'train base eager'" in source and notes == []  # compiled failed
    older = gpu_check_json(tmp_path, mfu_counted_pct=None)
    data = json.loads(open(older).read())
    del data["sections"]["train base eager"]["mfu_counted_pct"]
    open(older, "w").write(json.dumps(data))
    mfu, _, notes = bill.mfu_from_gpu_check(older, base, compiled=False, gpu_type="A100")
    assert mfu == 0.20 and any("overestimate" in n for n in notes) and any("applied to A100" in n for n in notes)
    with pytest.raises(ConfigError, match="no finished train row"):
        bill.mfu_from_gpu_check(older, ModelConfig.big(37000), compiled=False, gpu_type="H200")
    with pytest.raises(ConfigError, match="plan.gpu_type = 'P100'"):
        bill.peak_for("P100")


def test_model_size_is_base_or_big_by_width():
    """gpu_check measures base and big: a deeper or shallower base is billed with base's MFU; a tiny model
    (model.SIZES' third name) with neither."""
    from model import SIZES

    assert bill.model_size(ModelConfig.base(100, n_encoder_layers=4)) == "base"
    assert bill.model_size(ModelConfig.big(100, n_decoder_layers=2)) == "big"
    assert bill.model_size(ModelConfig(vocab_size=100, **SIZES["tiny"])) is None


def test_plan_bills_with_the_cached_encode_stage_and_the_run_logs_it(tmp_path):
    """A run on GPUs (workers.use_gpu = true): the GPU bill, whatever this machine has (a CPU run's
    bill: tests/unit/plan/test_cpu_bill.py)."""
    cfg = load_config(None, [f"--run.work_dir={tmp_path / 'work'}", "--train.max_steps=100",
                             "--train.tokens_per_step=500", "--speed.max_tokens_per_batch=400", "--workers.num_workers=2",
                             "--checkpoint.interval_steps=20", "--workers.use_gpu=true",
                             "--model.d_model=32", "--model.d_ff=64", "--model.n_heads=2"])
    train_dir = write_reverse_task(tmp_path / "train", 400, 64, seed=0, length_jitter=3)
    plans = make_plan(cfg)
    by = {p.stage.name: p for p in plans}
    by["vocab"].manifest = Manifest(stage="vocab", key=by["vocab"].key, dir="", outputs={"vocab_size": 64})
    by["encode"].manifest = Manifest(stage="encode", key=by["encode"].key, dir="",
                                     outputs={"splits": {"train": {"dir": str(train_dir)}}})
    text = format_bill(cfg, plans, gpu_check_json(tmp_path))
    assert "the encode stage's 400 training pairs" in text and "2 x A100" in text
    assert "measured: gpu_check 'train base eager'" in text and "applied to A100" in text

    logged = {}
    ctx = SimpleNamespace(cfg=cfg, tracker=SimpleNamespace(log_params=logged.update))
    mc = ModelConfig(vocab_size=64, d_model=32, d_ff=64, n_heads=2)
    _log_bill(ctx, mc, load_lengths(str(train_dir)))
    lengths = load_lengths(str(train_dir))
    b = bill.make_bill(cfg, mc, lengths, bill.encode_lengths_source(lengths))
    assert logged["bill/hours"] == f"{b.hours:.4g}" and logged["bill/num_gpus"] == 2
    assert logged["bill/mfu_source"].startswith("an ASSUMPTION")


@pytest.mark.parametrize("mc", [TINY, ModelConfig(vocab_size=60, d_model=24, d_ff=40, n_heads=2, d_k=4, d_v=12,
                                                  n_encoder_layers=1, n_decoder_layers=2, tie_embeddings=False)],
                         ids=["tiny", "d_k<d_v untied"])
def test_the_op_count_is_what_a_step_of_the_real_widths_dispatches(mc):
    """`flops.count_step_ops` (a model of the same structure shrunk to 8 columns a head) against
    the model at its own widths run for real on this CPU, with the GPU's dropout and the loss in one
    piece (the CPU's own dropout and row chunks are not a GPU's path): the same number of aten ops,
    whatever the batch's size."""
    import torch

    from model import NonPad, Transformer, label_smoothed_nll

    torch.manual_seed(0)
    net = Transformer(mc, cpu_kernels=False).train()
    for B, S, T in [(3, 5, 4), (8, 11, 13)]:
        src = torch.randint(4, mc.vocab_size, (B, S))
        tgt = torch.randint(4, mc.vocab_size, (B, T))
        with flops.OpCounter() as ops:
            logits = net.logits(net(src, tgt, NonPad(torch.arange(B * S), torch.arange(B * T))))
            loss, _ = label_smoothed_nll(logits, tgt.reshape(-1), 0.1, mc.pad_id, cpu_chunk_elements=1 << 40)
            loss.backward()
        assert ops.count == flops.count_step_ops(mc, 0.1), (B, S, T)


def test_the_host_cost_per_op_is_the_measured_step_over_the_counted_ops():
    """61.6 ms of host time per eager step of the Multi30k tiny recipe (two micro-batches) on an H200
    machine; if the model's op count changes, the constant must be measured again."""
    cfg = load_config(["configs/multi30k-tiny.toml"], [])
    mc = ModelConfig(vocab_size=cfg.vocab.size, d_model=cfg.model.d_model, d_ff=cfg.model.d_ff,
                     n_heads=cfg.model.n_heads, n_encoder_layers=cfg.model.n_encoder_layers,
                     n_decoder_layers=cfg.model.n_decoder_layers, dropout=cfg.model.dropout,
                     max_positions=cfg.model.max_positions)
    assert bill.HOST_S_PER_OP == pytest.approx(61.6e-3 / (2 * flops.count_step_ops(mc, 0.1)), rel=0.01)


def test_an_eager_bill_is_bounded_by_the_host_and_prints_how():
    """The Multi30k tiny recipe, eager: seconds of math at the assumed MFU, minutes measured
    (docs/benchmarks.md, "The bill's host floor"); the bill's hours are its host floor, computed from
    the printed figures."""
    cfg = load_config(["configs/multi30k-tiny.toml"], ["--speed.compile=false"])
    mc = ModelConfig(vocab_size=8000, d_model=128, d_ff=256, n_heads=4, n_encoder_layers=4, n_decoder_layers=4,
                     dropout=0.3)
    b = bill.make_bill(cfg, mc)
    text = b.format()
    m = re.search(r"host floor +max_steps x micro-batches x aten ops x s per op / 3600 = (\d+) x ([0-9.]+) x "
                  r"([0-9,]+) x ([0-9.e+-]+) / 3600 = ([0-9.e+-]+) h", text)
    assert m, text
    steps, micro, ops, per_op, host = (float(g.replace(",", "")) for g in m.groups())
    assert host == pytest.approx(steps * micro * ops * per_op / 3600, rel=1e-3)
    compute = _number(text, r"compute +max_steps .* = ([0-9.e+-]+) h\n")
    assert host > 10 * compute  # host-bound, as measured
    assert _number(text, r"hours +max\(compute, host floor\) = .* = ([0-9.e+-]+) h") == pytest.approx(host, rel=1e-3)
    assert "(host-bound)" in text and b.hours == b.host_hours
    assert 6 * 60 < b.hours * 3600 < 12 * 60  # the measured ~9 min, within what its causes explain
    compiled = bill.make_bill(load_config(["configs/multi30k-tiny.toml"], ["--speed.compile=true"]), mc)
    assert compiled.hours == compiled.compute_hours and "host floor is not measured" in compiled.format()


def test_the_assumed_corpus_is_the_one_a_config_keeps():
    """Before anything is encoded the shapes line counts the corpus the run will train on: the
    source's size, or `data.max_pairs_per_corpus` from each of its training corpora (local mode)."""
    from pipeline.data import sources

    registry = {"wmt14": sources.wmt14, "multi30k": sources.multi30k}
    for (source, lang), n in bill.TRAIN_CORPORA.items():
        assert n == sum(c.split == "train" for c in registry[source]("en", lang)), (source, lang)
    local = load_config("configs/local.toml")  # News Commentary alone (data.corpora)
    assert bill.assumed_pairs(local) == 1 * local.data.max_pairs_per_corpus == 36_000
    assert bill.assumed_pairs(load_config("configs/base.toml")) == bill.ASSUMED_PAIRS["wmt14"]
    every = ["--data.corpora=", "--data.max_pairs_per_corpus=12000"]
    assert bill.assumed_pairs(load_config("configs/local.toml", ["--data.tgt_lang=fr", *every])) == 5 * 12_000
    assert bill.assumed_pairs(load_config("configs/local.toml", every)) == 3 * 12_000
    mc = bill.model_config_for(local, {"vocab_size": local.vocab.size})
    assert "over 36,000 pairs of assumed lengths" in bill.epoch_shapes(local, mc)
