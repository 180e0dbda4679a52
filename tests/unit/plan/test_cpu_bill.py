"""The bill of a run on this CPU (pipeline/plan/cpu_rate.py, pipeline/plan/cpu_bill.py): the step's
matrix products against torch's own FLOP counter; the step's rate as the FLOP-weighted harmonic
mean, by hand; the printed hours from a rate injected, by hand; which machine a config is billed
on; --plan's bill and the train run's params on a CPU, and a GPU config still billed on GPUs."""

from __future__ import annotations

import math
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from model import ModelConfig, NonPad, Transformer, label_smoothed_nll
from pipeline.config import load_config
from pipeline.plan import bill, cpu_bill, cpu_rate
from pipeline.plan.cpu_rate import Gemm, MatmulRate
from pipeline.plan.flops import MicroShape
from pipeline.stage import Manifest
from pipeline.train.corpus import load_lengths
from pipeline.train.device import resolve_precision
from pipeline.plan.train_bill import train_bill
from pipeline.train.driver import _log_bill, local_cpu_training
from tests.support.synthetic import write_reverse_task
from workflows.runner import format_bill, make_plan

REPO = Path(__file__).resolve().parents[3]

TINY = ModelConfig(vocab_size=50, d_model=16, d_ff=32, n_heads=2, n_encoder_layers=2, n_decoder_layers=1, dropout=0.1)
SMALL = ["--train.max_steps=1000", "--train.tokens_per_step=3000", "--speed.max_tokens_per_batch=2000",
         "--model.d_model=64", "--model.d_ff=128", "--model.n_heads=2", "--vocab.size=500",
         "--checkpoint.interval_steps=300"]


def _number(text: str, pattern: str) -> float:
    m = re.search(pattern, text)
    assert m, (pattern, text)
    return float(m.group(1).replace(",", ""))


def test_the_recorded_products_are_the_matmul_flops_torch_counts():
    """`step_gemms`' products, each times its count, against torch's FlopCounterMode's mm and addmm
    FLOPs for the same micro-batch (attention's bmm left out, as the rate leaves it out)."""
    micro = MicroShape(B=3, S=7, T=6, Ms=15, Mt=14)
    gemms = cpu_rate.step_gemms(TINY, micro)
    with torch.device("meta"):
        model = Transformer(TINY)
    long = dict(dtype=torch.long, device="meta")
    with FlopCounterMode(display=False) as counter:
        hidden = model(torch.full((3, 7), TINY.eos_id, **long), torch.full((3, 6), TINY.bos_id, **long),
                       NonPad(torch.empty(15, **long), torch.empty(14, **long)))
        label_smoothed_nll(model.logits(hidden), torch.full((14,), TINY.eos_id, **long), 0.1,
                           TINY.pad_id)[0].backward()
    by_op = counter.get_flop_counts()["Global"]
    assert sum(g.count * g.flops for g in gemms) == by_op[torch.ops.aten.mm] + by_op[torch.ops.aten.addmm]
    # The output projection's three products: forward, the input's gradient, the weight's gradient.
    assert {g.mkn for g in gemms if TINY.vocab_size in g.mkn} == {(14, 16, 50), (14, 50, 16), (50, 14, 16)}


def test_the_steps_rate_is_its_flops_over_its_seconds_at_each_products_rate():
    """Two products by hand: 4 calls of 2 GFLOP at 100 GFLOP/s (80 ms) and one of 8 GFLOP at 50
    (160 ms): 16 GFLOP in 240 ms, 66.7 GFLOP/s (not the 75 of a plain mean)."""
    a = Gemm(((1000, 1000), (1000, 1)), ((1000, 1000), (1000, 1)), False, 4)
    b = Gemm(((2000, 1000), (1000, 1)), ((1000, 2000), (1, 1000)), True, 1)
    rate = MatmulRate(dtype="fp32", threads=2, cpu="a CPU", gemms=((a, 100e9), (b, 50e9)), wall_s=0.1)
    assert (a.flops, b.flops) == (2e9, 4e9 * 2)
    assert rate.seconds == pytest.approx(0.24) and rate.rate == pytest.approx(16e9 / 0.24)
    assert b.label() == "2000x1000 @ 1000x2000ᵀ + bias"
    assert "2 thread(s), fp32, measured 66.7 GFLOP/s" in rate.describe()


def test_measure_times_each_product_with_the_threads_asked_and_restores_them():
    before = torch.get_num_threads()
    rate = cpu_rate.measure(TINY, MicroShape(B=4, S=9, T=8, Ms=30, Mt=28), "fp32", 1)
    assert torch.get_num_threads() == before
    assert rate.threads == 1 and rate.dtype == "fp32" and len(rate.gemms) >= 6
    assert all(math.isfinite(r) and r > 0 for _, r in rate.gemms)
    with pytest.raises(ValueError, match="'fp16'"):
        cpu_rate.measure(TINY, MicroShape(B=1, S=2, T=2, Ms=2, Mt=2), "fp16", 1)


def test_the_printed_hours_follow_from_an_injected_rate():
    """A fake measured rate (one product at 50 GFLOP/s): the steps' and the checkpoints' hours by
    hand from the bill's own printed figures and the module's constants."""
    cfg = load_config(None, SMALL)
    mc = ModelConfig(vocab_size=500, d_model=64, d_ff=128, n_heads=2)
    g = Gemm(((100, 64), (64, 1)), ((64, 500), (1, 64)), False)
    fake = MatmulRate(dtype="fp32", threads=3, cpu="Fake CPU 9000", gemms=((g, 50e9),), wall_s=0.5)
    b = cpu_bill.make_cpu_bill(cfg, mc, "fp32", 3, rate=fake)
    text = b.format()
    assert text.startswith("bill of the train stage: this CPU (Fake CPU 9000): 3 thread(s), fp32, measured 50.0 "
                           "GFLOP/s, to train.max_steps = 1000")
    assert "A100" not in text and "GPU" not in text
    flops = _number(text, r"FLOPs per step +([0-9.e+-]+) counted")
    assert _number(text, r"matmul rate +([0-9.e+-]+) FLOP/s") == 50e9
    steps_h = 1000 * flops / (50e9 * cpu_bill.STAGE_STEP_SHARE) / 3600
    ckpt_h = math.ceil(1000 / 300) * cpu_bill.CHECKPOINT_S / 3600  # 300, 600, 900 and the last step
    assert _number(text, r"steps +max_steps .* = ([0-9.e+-]+) h") == pytest.approx(steps_h, rel=1e-3)
    assert _number(text, r"checkpoints +checkpoints x s each / 3600 = (\d+) x") == 4
    assert _number(text, r"hours +steps \+ checkpoints = .* = ([0-9.e+-]+) h") == pytest.approx(steps_h + ckpt_h,
                                                                                              rel=1e-3)
    assert b.hours == pytest.approx(steps_h + ckpt_h)
    assert b.params()["bill/hours"] == f"{b.hours:.4g}" and b.params()["bill/matmul_rate"] == "5e+10"


def test_which_machine_a_config_is_billed_on(monkeypatch):
    """This CPU for a local run that trains on it; GPUs for use_gpu = true, a cluster, or a GPU here."""
    on = lambda *o: bill.trains_on_this_cpu(load_config(None, list(o)))  # noqa: E731
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert on() and on("--workers.use_gpu=false")
    assert not on("--workers.use_gpu=true")
    assert not on("--run.ray_address=10.0.0.1:6379")
    monkeypatch.setenv("RAY_ADDRESS", "http://127.0.0.1:8265")  # `ray job submit` on a cluster
    assert not on()
    monkeypatch.delenv("RAY_ADDRESS")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert not on() and on("--workers.use_gpu=false")


def test_a_local_cpu_worker_trains_as_the_run_would():
    cfg = load_config(["configs/multi30k-tiny.toml"], [])
    precision, threads = local_cpu_training(cfg)
    assert precision == resolve_precision("auto", torch.device("cpu"))
    assert threads == max(1, torch.multiprocessing.cpu_count())  # dev_bleu.resources = "CPU=0": no spare
    assert local_cpu_training(load_config(None, ["--workers.cpus_per_worker=3"]))[1] == 3


def test_plan_and_the_run_bill_this_cpu_and_a_gpu_config_still_bills_gpus(tmp_path, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = [f"--run.work_dir={tmp_path / 'work'}", "--train.max_steps=100", "--train.tokens_per_step=500",
            "--speed.max_tokens_per_batch=400", "--checkpoint.interval_steps=20",
            "--model.d_model=32", "--model.d_ff=64", "--model.n_heads=2"]
    cfg = load_config(None, args)
    train_dir = write_reverse_task(tmp_path / "train", 400, 64, seed=0, length_jitter=3)
    plans = make_plan(cfg)
    by = {p.stage.name: p for p in plans}
    by["vocab"].manifest = Manifest(stage="vocab", key=by["vocab"].key, dir="", outputs={"vocab_size": 64})
    by["encode"].manifest = Manifest(stage="encode", key=by["encode"].key, dir="",
                                     outputs={"splits": {"train": {"dir": str(train_dir)}}})
    text = format_bill(cfg, plans)
    precision, threads = local_cpu_training(cfg)
    assert text.startswith(f"bill of the train stage: this CPU ({cpu_rate.cpu_name()}): {threads} thread(s), "
                           f"{precision}, measured ")
    assert "the encode stage's 400 training pairs" in text and "x A100" not in text
    assert "checkpoints x s each / 3600 = 5 x" in text

    gpu = format_bill(load_config(None, args + ["--workers.use_gpu=true", "--workers.num_workers=2"]), plans)
    assert gpu.startswith("bill of the train stage: 2 x A100") and "this CPU" not in gpu

    logged = {}
    ctx = SimpleNamespace(cfg=cfg, tracker=SimpleNamespace(log_params=logged.update))
    _log_bill(ctx, ModelConfig(vocab_size=64, d_model=32, d_ff=64, n_heads=2), load_lengths(str(train_dir)))
    assert logged["bill/machine"].startswith("this CPU (") and "bill/num_gpus" not in logged
    assert float(logged["bill/hours"]) > 0


GPU_RECIPES = {"base.toml", "big.toml", "enfr-base.toml", "enfr-big.toml", "cluster.toml"}  # the paper's 8 GPUs
LAPTOP_RECIPES = {"local.toml", "multi30k-tiny.toml", "multi30k-fast.toml"}


def test_each_shipped_config_is_billed_on_the_machine_it_trains_on(monkeypatch):
    """On a CPU-only machine: a paper row is billed for the GPUs it names (never this CPU, and never
    refused for its bf16 where the CPU has none), a laptop recipe for this CPU."""
    from pipeline.train import device

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    shipped = {p.name for p in (REPO / "configs").glob("*.toml")} - {"cluster-overlay.toml", "one-gpu.toml"}
    assert shipped == GPU_RECIPES | LAPTOP_RECIPES, "a new shipped config: say where it trains"
    for name in sorted(GPU_RECIPES):  # where a run trains does not depend on the CPU's class
        assert not bill.trains_on_this_cpu(load_config(REPO / "configs" / name)), name
    for name in sorted(LAPTOP_RECIPES):
        assert bill.trains_on_this_cpu(load_config(REPO / "configs" / name)), name
    monkeypatch.setattr(device, "cpu_bf16_features", lambda: [])  # the class that refused base's bf16
    cfg = load_config(REPO / "configs" / "base.toml")  # its bf16: refused on this CPU, were it billed here
    b = train_bill(cfg, bill.model_config_for(cfg, {"vocab_size": cfg.vocab.size}),
                   lambda: local_cpu_training(cfg))
    assert b.format().startswith(f"bill of the train stage: 8 x {cfg.plan.gpu_type} to")
    one = load_config([REPO / "configs" / "base.toml", REPO / "configs" / "one-gpu.toml"])
    assert bill.make_bill(one, bill.model_config_for(one, {"vocab_size": one.vocab.size})).num_gpus == 1
