"""The fp16 path (`speed.precision = "fp16"`, GPUs without bf16: V100, T4) on this CPU: torch has
fp16 autocast and a GradScaler for the CPU device. The config check refuses fp16 on CPUs for users,
so this drives the loop's step and checkpoint code directly: losses close to fp32, an overflowing
step skipped with the scale lowered, the scaler's state saved in the checkpoint and a resumed run
continuing with it exactly."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from model import ModelConfig, Transformer, make_optimizer, make_scheduler
from pipeline.batch_plan import step_groups
from pipeline.train import feeder
from pipeline.train.feeder import BatchLayout, to_device
from pipeline.train import checkpoint as train_checkpoint
from pipeline.train.corpus import load_corpus
from pipeline.train.checkpoint import Progress
from pipeline.train.step import LossSettings, accumulate_gradients, optimizer_step
from tests.support.synthetic import write_reverse_task
from tests.unit.train.test_loop import VOCAB, one_thread  # noqa: F401 (fixture)

MC = ModelConfig(vocab_size=VOCAB, d_model=32, d_ff=64, n_heads=2, n_encoder_layers=1, n_decoder_layers=1,
                 dropout=0.0)
FP16 = lambda: torch.autocast("cpu", dtype=torch.float16)  # noqa: E731 (the loop's autocast factory)


@pytest.fixture(scope="module")
def steps(tmp_path_factory) -> list[list]:
    """Eight steps of real token-bucketed micro-batches (the loop's plan, split and collate)."""
    d = load_corpus(str(write_reverse_task(tmp_path_factory.mktemp("fp16") / "train", 200, VOCAB, seed=0)))
    rows = np.arange(len(d.src_len))
    plan = step_groups.plan_epoch(rows, d.src_len, d.tgt_len, 400, 1, 0)[:8]
    out = []
    for g in plan:
        split = step_groups.split_step(g, d.src_len, d.tgt_len, 1, 200)
        out.append([to_device(feeder.collate(c, d,
                                                    BatchLayout(pad_id=MC.pad_id, bos_id=MC.bos_id, eos_id=MC.eos_id)),
                              torch.device("cpu"))
                    for c in split.chunks[0]])
    return out


def build(scaler: torch.amp.GradScaler | None):
    torch.manual_seed(0)
    model = Transformer(MC)
    opt = make_optimizer(model)
    return model, opt, make_scheduler(opt, MC.d_model, 4), scaler


def train(parts, steps, autocast) -> list[float]:
    model, opt, sched, scaler = parts
    losses = []
    for micro in steps:
        tgt = sum(int((mb.tgt_out != MC.pad_id).sum()) for mb in micro)
        loss, _ = accumulate_gradients(model, micro, tgt, 1,
                                       LossSettings(label_smoothing=0.1, pad_id=MC.pad_id, autocast=autocast,
                                                    scaler=scaler))
        optimizer_step(model, opt, sched, scaler, 0.0, False)
        losses.append(float(loss) / tgt)
    return losses


def test_fp16_losses_track_fp32(steps):
    fp32 = train(build(None), steps, contextlib.nullcontext)
    fp16 = train(build(torch.amp.GradScaler("cpu")), steps, FP16)
    assert fp32 != fp16  # autocast is on
    assert max(abs(a - b) / a for a, b in zip(fp32, fp16)) < 0.01  # fp16 rounding only (10-bit mantissa)


def test_an_overflowing_step_is_skipped_and_the_scale_lowered(steps):
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 100)  # fp16 gradients overflow to inf
    model, opt, sched, _ = parts = build(scaler)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    train(parts, steps[:1], FP16)
    assert scaler.get_scale() == 2.0 ** 99  # backoff_factor 0.5
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # the step was skipped
    # Adam's moments untouched (a fused/foreach Adam is called and skips the update itself)
    assert all(float(st["exp_avg"].abs().sum()) == 0 for st in opt.state.values() if "exp_avg" in st)
    train(parts, steps[1:3], FP16)
    assert scaler.get_scale() < 2.0 ** 99  # lowered again until the gradients are finite


def test_the_scaler_state_is_checkpointed_and_a_resume_continues_with_it(steps, tmp_path):
    growth = dict(init_scale=2.0 ** 10, growth_interval=3)  # the scale grows within these steps
    straight = build(torch.amp.GradScaler("cpu", **growth))
    expected = train(straight, steps, FP16)

    first = build(torch.amp.GradScaler("cpu", **growth))
    head = train(first, steps[:5], FP16)
    model, opt, sched, scaler = first
    train_checkpoint.save(tmp_path, model=model, optimizer=opt, scheduler=sched, scaler=scaler,
                          progress=Progress(step=5), model_config=MC.to_dict())
    state = torch.load(tmp_path / train_checkpoint.STATE_FILE, weights_only=True)
    assert scaler.get_scale() != torch.amp.GradScaler("cpu").get_scale()  # not the default: a real state
    assert state["scaler"]["scale"] == scaler.get_scale()
    assert state["scaler"]["_growth_tracker"] == scaler._get_growth_tracker()

    resumed = build(torch.amp.GradScaler("cpu"))  # default state: the checkpoint must replace it
    progress = train_checkpoint.load(tmp_path, model=resumed[0], optimizer=resumed[1], scheduler=resumed[2],
                                     scaler=resumed[3], device=torch.device("cpu"))
    assert progress.step == 5 and resumed[3].get_scale() == scaler.get_scale()
    assert head + train(resumed, steps[5:], FP16) == expected
