"""The bill of a train stage that runs on this machine's CPU (`bill.trains_on_this_cpu`).

    steps       = max_steps x FLOPs per step / (matmul rate x step share) / 3600
    checkpoints = checkpoints x seconds per checkpoint / 3600
    hours       = steps + checkpoints

- FLOPs per step: counted as the GPU bill counts them (`bill.count`: the model's matmuls and
  attention over sampled steps of the real batch plan).
- Matmul rate: measured when the bill is made (`cpu_rate.measure`, about a second): this CPU's
  rate at the matrix products of a micro-batch of the sampled steps (the median one by target
  positions), in the dtype the step will run in and with the worker's torch threads; the caller
  passes both (`pipeline.train.driver.local_cpu_training`: the run's own rules).
- Step share: `STAGE_STEP_SHARE`, measured: the train stage's steps (log windows without a
  checkpoint) as a share of that rate, measured beside it. What a step does besides its matmuls
  (the loss, dropout, LayerNorm, Adam, the host's dispatches, the loop and Ray's processes on the
  same cores) is in it. It is one model's share on one machine: a wider model spends more of its
  step in matmuls, so the bill says where the share was measured.
- Checkpoints: `CHECKPOINT_S` each, measured: what a log window holding a checkpoint took over
  one without (the dev loss, the checkpoint written and its dev BLEU validation on the same
  cores, as the Multi30k tiny recipe runs them together), times the checkpoints the run writes
  (`checkpoint.interval_steps`).

The stages before training (download, prepare, vocab, encode) and after it (average, export,
translate, score) are not in it: about a minute together for Multi30k on this machine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from model import ModelConfig
from pipeline.batch_plan.step_groups import worker_range
from pipeline.config import Config
from pipeline.plan import cpu_rate
from pipeline.plan.bill import Counted, count
from pipeline.plan.cpu_rate import MatmulRate
from pipeline.plan.flops import MicroShape, six_n_t

# The train stage's step as a share of `cpu_rate.measure`'s rate, and a checkpoint's extra
# seconds: the Multi30k tiny recipe (configs/multi30k-tiny.toml) on a 2-core AMD EPYC (AVX2, no
# native bf16: fp32, 2 threads), docs/benchmarks.md, "This CPU's matmul rate and the CPU bill".
STAGE_STEP_SHARE = 0.512  # 9.716e10 FLOPs / (140 GFLOP/s x 1.355 s): the windows without a checkpoint
BARE_STEP_SHARE = 0.620  # the bare step's (benchmarks/matmul_rate.py): printed beside it, not billed
CHECKPOINT_S = 4.1  # a window with a checkpoint over one without: 6.3 s and 1.8 s in two runs
MEASURED_ON = ("the Multi30k tiny recipe's train stage on a 2-core AMD EPYC, fp32 (docs/benchmarks.md, "
               "\"This CPU's matmul rate and the CPU bill\")")


@dataclass(kw_only=True)
class CpuBill:
    """The figures of a CPU bill (every one printed, so the hours can be recomputed from the text)."""

    counted: Counted
    max_steps: int
    rate: MatmulRate
    micro: MicroShape  # the micro-batch the rate was measured at
    checkpoints: int
    share: float = STAGE_STEP_SHARE
    checkpoint_s: float = CHECKPOINT_S
    notes: tuple[str, ...] = ()

    @property
    def flops_per_step(self) -> float:
        return self.counted.flops_per_step

    @property
    def s_per_step(self) -> float:
        return self.counted.flops_per_step / (self.rate.rate * self.share)

    @property
    def step_hours(self) -> float:
        return self.max_steps * self.s_per_step / 3600

    @property
    def checkpoint_hours(self) -> float:
        return self.checkpoints * self.checkpoint_s / 3600

    @property
    def hours(self) -> float:
        return self.step_hours + self.checkpoint_hours

    def params(self) -> dict[str, Any]:
        """The train run's MLflow params (`bill/...`), as the GPU bill's where they mean the same."""
        c = self.counted
        return {"bill/machine": self.rate.describe()[:450], "bill/flops_per_step": f"{c.flops_per_step:.4g}",
                "bill/flops_per_step_6nt": f"{six_n_t(c.num_params, c.tgt_tokens_per_step):.4g}",
                "bill/tgt_tokens_per_step": round(c.tgt_tokens_per_step), "bill/matmul_rate": f"{self.rate.rate:.4g}",
                "bill/step_share": f"{self.share:.4g}", "bill/hours": f"{self.hours:.4g}",
                "bill/step_hours": f"{self.step_hours:.4g}", "bill/checkpoint_hours": f"{self.checkpoint_hours:.4g}",
                "bill/lengths": c.lengths_source[:450]}

    def format(self) -> str:
        c, r = self.counted, self.rate
        lines = [
            f"bill of the train stage: {r.describe()}, to train.max_steps = {self.max_steps}",
            f"  parameters        {c.num_params:,} ({c.num_params / 1e6:.1f}M, the tied embedding once)",
            f"  batches           {c.lengths_source}; {len(c.steps)} step(s) sampled: "
            f"{c.tgt_tokens_per_step:,.0f} target + {c.src_tokens_per_step:,.0f} source tokens per step",
            f"  FLOPs per step    {c.flops_per_step:.4e} counted (torch FlopCounterMode on the model, meta device, "
            "forward + backward: matmuls and attention)",
            f"                    {six_n_t(c.num_params, c.tgt_tokens_per_step):.4e} by 6*N*T",
            f"  matmul rate       {r.rate:.4e} FLOP/s measured now in {r.wall_s:.1f} s: the step's {len(r.gemms)} "
            f"distinct matrix products at a micro-batch of {self.micro.Mt:,} target and {self.micro.Ms:,} source "
            f"positions, {r.dtype}, {r.threads} thread(s), each at its own rate (benchmarks/matmul_rate.py prints them)",
            f"  step share        {self.share:.3g} of that rate (measured: {MEASURED_ON}; the bare step's is "
            f"{BARE_STEP_SHARE:.3g})",
            f"  steps             max_steps x FLOPs per step / (rate x share) / 3600 = {self.max_steps} x "
            f"{c.flops_per_step:.4e} / ({r.rate:.4e} x {self.share:.3g}) / 3600 = {self.step_hours:.4g} h "
            f"({self.s_per_step:.3g} s a step)",
            f"  checkpoints       checkpoints x s each / 3600 = {self.checkpoints} x {self.checkpoint_s:.3g} / 3600 "
            f"= {self.checkpoint_hours:.4g} h (each: the dev loss, the checkpoint and its dev BLEU on the same cores)",
            f"  hours             steps + checkpoints = {self.step_hours:.4g} + {self.checkpoint_hours:.4g} "
            f"= {self.hours:.4g} h",
            *([f"  batch shapes      {c.shapes}"] if c.shapes else []),
            "  (the stages before and after training are not in it; once training runs, its progress line's ETA "
            "is measured)"]
        return "\n".join(lines + [f"  note: {n}" for n in self.notes])


def median_micro(steps: list[list[MicroShape]]) -> MicroShape:
    """The sampled micro-batch with the median target positions: where the rate is measured."""
    micro = sorted((m for s in steps for m in s if m.B), key=lambda m: (m.Mt, m.Ms))
    return micro[len(micro) // 2]


def make_cpu_bill(cfg: Config, mc: ModelConfig, precision: str, threads: int,
                  lengths: tuple[np.ndarray, np.ndarray] | None = None, lengths_source: str = "",
                  shapes: bool = False, rate: MatmulRate | None = None) -> CpuBill:
    """The CPU bill of `cfg`'s train stage for the model `mc`, its step in `precision` ("fp32" |
    "bf16") on `threads` torch threads (`bill.count`'s other arguments); `rate`: measured already
    (None: `cpu_rate.measure` now)."""
    c = count(cfg, mc, lengths, lengths_source, shapes)
    micro = median_micro(c.steps)
    rate = rate or cpu_rate.measure(mc, micro, precision, threads, cfg.train.label_smoothing)
    notes = []
    if rate.dtype != "fp32":
        notes.append(f"the step share was measured in fp32; this step runs in {rate.dtype}")
    if worker_range(cfg)[1] > 1:
        notes.append("the share was measured with one worker; more workers on one CPU share its cores")
    checkpoints = -(-cfg.train.max_steps // cfg.checkpoint.interval_steps)  # the last step's checkpoint too
    return CpuBill(counted=c, max_steps=cfg.train.max_steps, rate=rate, micro=micro, checkpoints=checkpoints,
                   notes=tuple(notes))
