"""The bill of the train stage on GPUs: FLOPs per step, wall time and GPU-hours to `train.max_steps`.
A run that trains on this machine's CPU (`trains_on_this_cpu`) is billed by `pipeline.plan.cpu_bill`
instead, on the same counted FLOPs (`count`).

    hours     = max_steps x FLOPs per step / (GPUs x peak FLOP/s per GPU x MFU) / 3600
    GPU-hours = GPUs x hours

- FLOPs per step: counted by torch's FLOP counter on the real model (`pipeline.plan.flops`, meta
  device, forward + backward) over sampled steps of the real batch plan: the encode stage's
  training lengths when it is cached, else `ASSUMED_LENGTHS` (stated in the bill). The 6·N·T
  rule's figure is printed beside it.
- GPUs: the most workers of `workers.num_workers` (one GPU each); peak: `PEAK_FLOPS[plan.gpu_type]`.
- MFU: measured by benchmarks/gpu_check.sh (`--mfu-from FILE` or `plan.mfu_from`: its train row
  for this model size, compiled or eager as `speed.compile`), else `plan.assumed_mfu`, printed
  as an assumption. gpu_check measures one GPU: the all-reduce between GPUs, validation and
  checkpoints are not in it, so the bill is a lower bound of the wall time; the progress line's
  ETA (measured) is the number to trust once training runs.
- The host floor: an eager step cannot be faster than the host dispatches its ops (a small model
  on a GPU is host-bound: docs/benchmarks.md, "The bill's host floor"). Its ops are counted
  (`flops.count_step_ops`, per micro-batch, times a worker's micro-batches per step) at
  `HOST_S_PER_OP` each, and an eager bill's hours are the larger of the two. A compiled step
  dispatches far fewer ops, by an amount not measured yet: its bill prints the eager floor as an
  upper bound of the host's share and counts the math only.

The driver logs the same figures as the train run's MLflow params (`params`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from model import ModelConfig, Transformer, size_name
from pipeline.batch_plan import step_groups
from pipeline.batch_plan.shapes import EpochShapes, ShapeBuckets, epoch_report
from pipeline.batch_plan.step_groups import worker_range
from pipeline.config import Config, ConfigError
from pipeline.config.devices import on_for
from pipeline.models import model_config_for
from pipeline.plan.flops import MicroShape, count_step_ops, six_n_t, step_flops
from pipeline.ray_env import ray_address

# Dense (no structured sparsity) 16-bit tensor-core peak per GPU: bf16, or fp16 on GPUs without
# bf16 (V100, T4), from NVIDIA's datasheets. Where a datasheet prints only the sparse figure
# ("with sparsity"), the dense one is half of it.
PEAK_FLOPS: dict[str, tuple[float, str]] = {
    "V100": (125e12, "NVIDIA V100 datasheet (SXM2): 125 TFLOPS fp16 tensor; no bf16"),
    "T4": (65e12, "NVIDIA T4 datasheet: 65 TFLOPS fp16 mixed precision; no bf16"),
    "A10": (125e12, "NVIDIA A10 datasheet: 125 TFLOPS bf16 tensor (250 with sparsity)"),
    "L4": (121e12, "NVIDIA L4 datasheet: 242 TFLOPS bf16 tensor with sparsity, 121 dense"),
    "A100": (312e12, "NVIDIA A100 datasheet (SXM and PCIe): 312 TFLOPS bf16 tensor (624 with sparsity)"),
    "L40S": (362e12, "NVIDIA L40S datasheet: 362 TFLOPS bf16 tensor (733 with sparsity)"),
    "H100-PCIe": (756e12, "NVIDIA H100 datasheet, PCIe: 1,513 TFLOPS bf16 tensor with sparsity, 756 dense"),
    "H100": (989e12, "NVIDIA H100 datasheet, SXM: 1,979 TFLOPS bf16 tensor with sparsity, 989 dense"),
    "H200": (989e12, "NVIDIA H200 datasheet, SXM: 1,979 TFLOPS bf16 tensor with sparsity, 989 dense"),
}

# Without the encode stage's lengths: pieces per source sentence ~ lognormal with median 25 and
# mean ~30 (sigma 0.6), target = source x U(0.8, 1.2). An assumption of the order of WMT14 EN-DE
# under a 37k shared BPE, not a measurement; the bill says when it uses it.
ASSUMED_LENGTHS = "assumed lengths (no cached encode output): source pieces ~ lognormal(median 25, sigma 0.6), " \
                  "target = source x U(0.8, 1.2)"
# The corpus `epoch_shapes` assumes when nothing is encoded yet: the source's training pairs
# (WMT14 EN-DE ~4.5M, §5.1; Multi30k 29,000); EN-FR's 36M is counted at EN-DE's size (seconds, not a minute).
ASSUMED_PAIRS = {"wmt14": 4_500_000, "multi30k": 29_000}
# Training corpora of each source and target language (pipeline/data/sources.py): with
# data.max_pairs_per_corpus the corpus is at most that many from each (of those data.corpora names, if it does).
TRAIN_CORPORA = {("wmt14", "de"): 3, ("wmt14", "fr"): 5, ("multi30k", "de"): 1}
# Host seconds per aten op of an eager GPU step, from the one measurement there is (docs/benchmarks.md,
# "The bill's host floor": an H200 machine, torch 2.11, bf16 autocast): the Multi30k tiny recipe's
# eager step took 61.6 ms of host CPU time for two micro-batches of 1,275 aten ops each
# (`flops.count_step_ops` of that model, fp32: the autocast casts and the optimizer are inside this
# per-op figure): 24.2 us per op.
# tests/unit/plan/test_bill.py keeps it consistent with the count. An assumption for other hosts.
HOST_S_PER_OP = 24.2e-6
SAMPLE_ROWS = 200_000  # rows the batch plan is built from (a uniform sample: the same length distribution)
SAMPLE_STEPS = 6  # steps counted: one per stratum of the steps sorted by length (steps are length buckets)


@dataclass(kw_only=True)
class Bill:
    """The figures of the bill (every one printed, so the hours can be recomputed from the text)."""

    num_params: int
    max_steps: int
    num_gpus: int
    gpu_type: str
    peak_flops: float
    peak_source: str
    mfu: float
    mfu_source: str  # where the MFU comes from; "assumption: ..." when not measured
    flops_per_step: float  # counted (mean over the sampled steps)
    tgt_tokens_per_step: float
    src_tokens_per_step: float
    lengths_source: str
    sampled_steps: int
    notes: tuple[str, ...] = ()
    shapes: str = ""  # `epoch_shapes`' line ("" = not computed)
    ops_per_micro_batch: int = 0  # `flops.count_step_ops`: forward + loss + backward
    micro_batches_per_worker: float = 1.0  # per step, the busiest worker's (mean over the sampled steps)
    compiled: bool = False  # speed.compile on a GPU: the host floor is not applied

    @property
    def flops_6nt(self) -> float:
        return six_n_t(self.num_params, self.tgt_tokens_per_step)

    @property
    def compute_hours(self) -> float:
        return self.max_steps * self.flops_per_step / (self.num_gpus * self.peak_flops * self.mfu) / 3600

    @property
    def host_s_per_step(self) -> float:
        """An eager step's host time: the busiest worker's ops x `HOST_S_PER_OP`."""
        return self.micro_batches_per_worker * self.ops_per_micro_batch * HOST_S_PER_OP

    @property
    def host_hours(self) -> float:
        return self.max_steps * self.host_s_per_step / 3600

    @property
    def hours(self) -> float:
        return self.compute_hours if self.compiled else max(self.compute_hours, self.host_hours)

    @property
    def gpu_hours(self) -> float:
        return self.num_gpus * self.hours

    def params(self) -> dict[str, Any]:
        """The train run's MLflow params (`bill/...`)."""
        return {"bill/flops_per_step": f"{self.flops_per_step:.4g}", "bill/flops_per_step_6nt": f"{self.flops_6nt:.4g}",
                "bill/tgt_tokens_per_step": round(self.tgt_tokens_per_step), "bill/num_gpus": self.num_gpus,
                "bill/gpu_type": self.gpu_type, "bill/peak_flops": f"{self.peak_flops:.4g}",
                "bill/mfu": f"{self.mfu:.4g}", "bill/mfu_source": self.mfu_source[:450],
                "bill/hours": f"{self.hours:.4g}", "bill/gpu_hours": f"{self.gpu_hours:.4g}",
                "bill/compute_hours": f"{self.compute_hours:.4g}", "bill/host_floor_hours": f"{self.host_hours:.4g}",
                "bill/lengths": self.lengths_source[:450]}

    def format(self) -> str:
        pct = f"{100 * self.mfu:.3g}%"
        lines = [
            f"bill of the train stage: {self.num_gpus} x {self.gpu_type} to train.max_steps = {self.max_steps}",
            f"  parameters        {self.num_params:,} ({self.num_params / 1e6:.1f}M, the tied embedding once)",
            f"  batches           {self.lengths_source}; {self.sampled_steps} step(s) sampled: "
            f"{self.tgt_tokens_per_step:,.0f} target + {self.src_tokens_per_step:,.0f} source tokens per step",
            f"  FLOPs per step    {self.flops_per_step:.4e} counted (torch FlopCounterMode on the model, meta device, "
            "forward + backward: matmuls and attention)",
            f"                    {self.flops_6nt:.4e} by 6*N*T (N = {self.num_params:,} parameters, "
            f"T = {self.tgt_tokens_per_step:,.0f} target tokens)",
            f"  peak              {self.peak_flops:.4e} FLOP/s per {self.gpu_type} ({self.peak_source})",
            f"  MFU               {self.mfu:.4g} = {pct} ({self.mfu_source})",
            f"  compute           max_steps x FLOPs per step / (GPUs x peak x MFU) / 3600 = {self.max_steps} x "
            f"{self.flops_per_step:.4e} / ({self.num_gpus} x {self.peak_flops:.4e} x {self.mfu:.4g}) / 3600 "
            f"= {self.compute_hours:.4g} h",
            f"  host floor        max_steps x micro-batches x aten ops x s per op / 3600 = {self.max_steps} x "
            f"{self.micro_batches_per_worker:.3g} x {self.ops_per_micro_batch:,} x {HOST_S_PER_OP:.3g} / 3600 "
            f"= {self.host_hours:.4g} h (an eager step's dispatches, {1e3 * self.host_s_per_step:.1f} ms a step"
            f"{'; compiled: not applied, an upper bound of the host share' if self.compiled else ''})",
            (f"  hours             compute (speed.compile: the host floor is not measured) = {self.hours:.4g} h"
             if self.compiled else
             f"  hours             max(compute, host floor) = max({self.compute_hours:.4g}, {self.host_hours:.4g}) "
             f"= {self.hours:.4g} h{' (host-bound)' if self.host_hours > self.compute_hours else ''}"),
            f"  GPU-hours         GPUs x hours = {self.gpu_hours:.4g}",
            *([f"  batch shapes      {self.shapes}"] if self.shapes else []),
            "  (the all-reduce, validation and checkpoints add to it; once training runs, "
            "its progress line's ETA is measured)"]
        return "\n".join(lines + [f"  note: {n}" for n in self.notes])


def peak_for(gpu_type: str) -> tuple[float, str]:
    if gpu_type not in PEAK_FLOPS:
        raise ConfigError(f"plan.gpu_type = {gpu_type!r}: unknown GPU (known: {', '.join(PEAK_FLOPS)})")
    return PEAK_FLOPS[gpu_type]


def model_size(mc: ModelConfig) -> str | None:
    """"base" / "big" when the model has Table 3's widths (gpu_check measures those two; the
    depth is not compared)."""
    return size_name(mc, among=("base", "big"), keys=("d_model", "d_ff", "n_heads"))


def mfu_from_gpu_check(path: str, mc: ModelConfig, compiled: bool, gpu_type: str) -> tuple[float, str, list[str]]:
    """(MFU, where from, notes) from a gpu_check JSON: its train row for this model size, as
    compiled (`speed.compile`) when it has one, else the other. A ConfigError naming the file when
    it has none."""
    try:
        report = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"--mfu-from / plan.mfu_from: cannot read {path} ({e})") from e
    size = model_size(mc)
    if report.get("smoke"):
        raise ConfigError(f"--mfu-from: {path} is a gpu_check --smoke run (it measures nothing)")
    sections = report.get("sections", {})
    names = [f"train {s} {m}" for s in ([size] if size else ["base", "big"])
             for m in (["compiled", "eager"] if compiled else ["eager", "compiled"])]
    for name in names:
        sec = sections.get(name, {})
        if sec.get("status") != "ok":
            continue
        notes = []
        if "mfu_counted_pct" in sec:
            mfu = sec["mfu_counted_pct"] / 100
        else:  # an older gpu_check: MFU of its 6 x matmul-parameter estimate (no attention): lower
            mfu = sec["mfu_pct"] / 100
            notes.append(f"{path} predates the counted MFU: its MFU is against 6 x matmul parameters (attention "
                         "left out), a lower figure, so these hours are an overestimate")
        device = str(report.get("env", {}).get("device", "?"))
        if gpu_type.split("-")[0].lower() not in device.lower():
            notes.append(f"MFU measured on {device}, applied to {gpu_type} (plan.gpu_type)")
        if size is None:
            notes.append(f"this model is neither base nor big: using gpu_check's '{name}' MFU")
        return mfu, f"measured: gpu_check '{name}' in {path}, on one {device}", notes
    raise ConfigError(f"--mfu-from: {path} has no finished train row among {', '.join(names)}")


def sample_steps(src_len: np.ndarray, tgt_len: np.ndarray, cfg: Config, num_steps: int = SAMPLE_STEPS,
                 ) -> tuple[list[list[MicroShape]], list[int]]:
    """Micro-batch shapes of `num_steps` steps of the real batch plan (epoch 0 of train.seed),
    one per stratum of the steps sorted by mean length, split over the most workers; and each
    step's busiest worker's micro-batch count."""
    tc = cfg.train
    rows = np.flatnonzero(step_groups.keep_mask(src_len, tgt_len, tc.max_len))
    if len(rows) > SAMPLE_ROWS:
        rows = np.sort(np.random.default_rng(tc.seed).choice(rows, SAMPLE_ROWS, replace=False))
    plan = step_groups.plan_epoch(rows, src_len, tgt_len, tc.tokens_per_step, tc.seed, 0)
    if not plan:
        raise ConfigError("train.tokens_per_step: the training split makes no step")
    by_len = sorted(plan, key=lambda g: float(np.mean(tgt_len[g])))
    picks = sorted({int((i + 0.5) * len(by_len) / num_steps) for i in range(num_steps)})
    workers = worker_range(cfg)[1]
    steps, busiest = [], []
    for i in picks:
        split = step_groups.split_step(by_len[min(i, len(by_len) - 1)], src_len, tgt_len, workers,
                                    cfg.speed.max_tokens_per_batch)
        steps.append([MicroShape.of(src_len[c], tgt_len[c]) for chunks in split.chunks for c in chunks if len(c)])
        busiest.append(max(sum(1 for c in chunks if len(c)) for chunks in split.chunks))
    return steps, busiest


def assumed_lengths(cfg: Config, n: int = 50_000) -> tuple[np.ndarray, np.ndarray]:
    """`ASSUMED_LENGTHS`, drawn with train.seed."""
    rng = np.random.default_rng(cfg.train.seed)
    src = np.exp(rng.normal(math.log(25.0), 0.6, size=n))
    tgt = src * rng.uniform(0.8, 1.2, size=n)
    return (np.clip(np.rint(src), 1, None).astype(np.int64), np.clip(np.rint(tgt), 1, None).astype(np.int64))


def shapes_report(cfg: Config, mc: ModelConfig, src_len: np.ndarray, tgt_len: np.ndarray) -> EpochShapes:
    """The distinct micro-batch shapes of epoch 0's batch plan with GPU shape buckets
    (`pipeline.batch_plan.shapes`), split over the most workers, and their padding."""
    tc = cfg.train
    rows = np.flatnonzero(step_groups.keep_mask(src_len, tgt_len, tc.max_len))
    plan = step_groups.plan_epoch(rows, src_len, tgt_len, tc.tokens_per_step, tc.seed, 0)
    workers = worker_range(cfg)[1]
    micro = [(src_len[c], tgt_len[c]) for g in plan
             for w in step_groups.split_step(g, src_len, tgt_len, workers, cfg.speed.max_tokens_per_batch).chunks
             for c in w if len(c)]
    return epoch_report(micro, ShapeBuckets(), mc.max_positions)


def assumed_pairs(cfg: Config) -> int:
    """The training pairs `epoch_shapes` assumes before anything is encoded: the source's corpus,
    cut to `data.max_pairs_per_corpus` from each of its corpora where that is set."""
    d = cfg.data
    n = ASSUMED_PAIRS.get(d.source, ASSUMED_PAIRS["wmt14"])
    corpora = len(d.corpora) or TRAIN_CORPORA.get((d.source, d.tgt_lang if d.src_lang == "en" else d.src_lang))
    if d.max_pairs_per_corpus and corpora:
        n = min(n, corpora * d.max_pairs_per_corpus)
    return n


def epoch_shapes(cfg: Config, mc: ModelConfig, lengths: tuple[np.ndarray, np.ndarray] | None = None) -> str:
    """One line: `shapes_report` over the training lengths (None: `assumed_pairs` pairs of
    `ASSUMED_LENGTHS`, the corpus the run keeps: the count grows with the corpus)."""
    if lengths is None:
        n = assumed_pairs(cfg)
        lengths, where = assumed_lengths(cfg, n), f"{n:,} pairs of assumed lengths"
    else:
        where = f"the training split's {len(lengths[0]):,} pairs"
    report = shapes_report(cfg, mc, *lengths)
    use = {"auto": "on a GPU", True: "on", False: "OFF"}[cfg.speed.shape_buckets]
    return (f"epoch 0 over {where}, {worker_range(cfg)[1]} worker(s), speed.shape_buckets {use}: "
            f"{report.format()}")


@dataclass(frozen=True, kw_only=True)
class Counted:
    """What every bill counts, whatever machine it prices: the model and its sampled steps."""

    num_params: int
    flops_per_step: float  # counted (mean over the sampled steps)
    steps: list[list[MicroShape]]  # the sampled steps' micro-batches (all workers')
    busiest: list[int]  # each sampled step's busiest worker's micro-batch count
    lengths_source: str
    shapes: str  # `epoch_shapes`' line ("" = not computed)

    @property
    def tgt_tokens_per_step(self) -> float:
        return float(np.mean([sum(m.Mt for m in s) for s in self.steps]))

    @property
    def src_tokens_per_step(self) -> float:
        return float(np.mean([sum(m.Ms for m in s) for s in self.steps]))


def count(cfg: Config, mc: ModelConfig, lengths: tuple[np.ndarray, np.ndarray] | None = None,
          lengths_source: str = "", shapes: bool = False) -> Counted:
    """The counted part of `cfg`'s bill for the model `mc`; `lengths` = the training split's
    (src_len, tgt_len) (None: `ASSUMED_LENGTHS`); `shapes`: count an epoch's batch shapes too
    (`epoch_shapes`: seconds for WMT14's 4.5M pairs)."""
    shapes_line = epoch_shapes(cfg, mc, lengths) if shapes else ""
    if lengths is None:
        lengths, lengths_source = assumed_lengths(cfg), ASSUMED_LENGTHS
    steps, busiest = sample_steps(*lengths, cfg)
    flops = [step_flops(mc, step, cfg.train.label_smoothing) for step in steps]
    with torch.device("meta"):
        num_params = Transformer(mc).num_parameters()
    return Counted(num_params=num_params, flops_per_step=float(np.mean(flops)), steps=steps, busiest=busiest,
                   lengths_source=lengths_source, shapes=shapes_line)


def make_bill(cfg: Config, mc: ModelConfig, lengths: tuple[np.ndarray, np.ndarray] | None = None,
              lengths_source: str = "", mfu_from: str = "", shapes: bool = False) -> Bill:
    """The GPU bill of `cfg`'s train stage for the model `mc` (`count`'s arguments); `mfu_from`
    overrides `plan.mfu_from`."""
    c = count(cfg, mc, lengths, lengths_source, shapes)
    peak, peak_source = peak_for(cfg.plan.gpu_type)
    path = mfu_from or cfg.plan.mfu_from
    notes: list[str] = []
    if path:
        mfu, mfu_source, notes = mfu_from_gpu_check(path, mc, on_for(cfg.speed.compile, "cuda"), cfg.plan.gpu_type)
    else:
        mfu, mfu_source = cfg.plan.assumed_mfu, ("an ASSUMPTION (plan.assumed_mfu), not measured: measure it with "
                                           "benchmarks/gpu_check.sh and pass --mfu-from gpu_check.json")
    if cfg.speed.precision == "fp32":
        notes.append("speed.precision = fp32: the peak is the 16-bit one; fp32 (TF32) reaches less")
    return Bill(num_params=c.num_params, max_steps=cfg.train.max_steps, num_gpus=worker_range(cfg)[1],
                gpu_type=cfg.plan.gpu_type, peak_flops=peak, peak_source=peak_source, mfu=mfu, mfu_source=mfu_source,
                flops_per_step=c.flops_per_step, tgt_tokens_per_step=c.tgt_tokens_per_step,
                src_tokens_per_step=c.src_tokens_per_step, lengths_source=c.lengths_source,
                sampled_steps=len(c.steps), notes=tuple(notes), shapes=c.shapes,
                ops_per_micro_batch=count_step_ops(mc, cfg.train.label_smoothing),
                micro_batches_per_worker=float(np.mean(c.busiest)), compiled=on_for(cfg.speed.compile, "cuda"))


def trains_on_this_cpu(cfg: Config) -> bool:
    """Whether `cfg`'s run trains on this machine's CPU, so that its bill is this CPU's
    (`pipeline.plan.cpu_bill`): a local run (no Ray address: `pipeline.ray_env.ray_address`) with
    `workers.use_gpu` false, or "auto" where torch sees no CUDA device. A run on a cluster, or on
    GPUs (`workers.use_gpu = true` prices one from a CPU-only machine), is billed on `plan.gpu_type`."""
    if ray_address(cfg) != "local" or cfg.workers.use_gpu is True:
        return False
    return cfg.workers.use_gpu is False or not torch.cuda.is_available()


def encode_lengths_source(lengths: tuple[np.ndarray, np.ndarray]) -> str:
    """How a bill names the encode stage's training lengths (src_len, tgt_len) it was made at."""
    return f"the encode stage's {len(lengths[0]):,} training pairs"


def num_parameters(cfg: Config, vocab_size: int | None = None) -> int:
    """Trainable parameters (the tied embedding counted once) of ``cfg.model`` at ``vocab_size``
    (default ``vocab.size``: the vocab stage's model has exactly that many pieces unless
    SentencePiece could not reach it). The Transformer is built on PyTorch's ``meta`` device: real
    modules, real shapes, no memory, so the count is the train stage's model's (Table 3's rows)."""
    mc = model_config_for(cfg, {"vocab_size": vocab_size or cfg.vocab.size})
    with torch.device("meta"):
        return Transformer(mc).num_parameters()
