"""This CPU's matmul rate at the training step's own products, beside the bare step: the step's
share of the machine's matmul roofline, in one run.

    .venv/bin/python benchmarks/matmul_rate.py [--config configs/multi30k-tiny.toml]
        --train-dir work/multi30k/encode/<key>/train [--steps 12] [--repeats 3] [--threads 0] [--dtypes fp32,bf16]

A. Each distinct matrix product of one micro-batch (`pipeline.plan.cpu_rate.step_gemms`, at the
   median micro-batch of the measured steps): how often a micro-batch runs it, its GFLOP/s in fp32
   and in bf16, and the step's rate in each dtype (the FLOP-weighted harmonic mean:
   `cpu_rate.MatmulRate.rate`, what `--plan` bills a CPU run with).
B. The bare step (`train_bench.run_bare`: forward, loss, backward, Adam; the loop's micro-batches
   collated up front) on the config's real batches in the dtype `speed.precision` resolves to on
   this CPU, best of --repeats: s/step, counted FLOPs per step (`flops.step_flops` on its
   micro-batches' shapes), the step's FLOP/s, and that as a share of A's rate in the step's dtype
   and in bf16. The bare share is what pipeline/plan/cpu_bill.py's `BARE_STEP_SHARE` holds.

Threads: --threads, else what a local run's CPU worker gets (`driver.local_cpu_training`). Run it
alone (`flock /tmp/heavy.lock`): on 2 cores another torch job makes every figure worthless.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from pipeline.config import load_config  # noqa: E402
from pipeline.cpu_threads import use_threads  # noqa: E402
from pipeline.models import model_config_for  # noqa: E402
from pipeline.plan import cpu_rate  # noqa: E402
from pipeline.plan.flops import MicroShape, step_flops  # noqa: E402
from pipeline.train.driver import local_cpu_training  # noqa: E402


def shape_of(mb) -> MicroShape:
    """A collated micro-batch's `MicroShape` (rows, columns, computed positions)."""
    return MicroShape(B=int(mb.src.shape[0]), S=int(mb.src.shape[1]), T=int(mb.tgt_in.shape[1]),
                      Ms=int(mb.src_index.numel()), Mt=int(mb.tgt_index.numel()))


def print_rates(rates: dict[str, cpu_rate.MatmulRate]) -> None:
    first = next(iter(rates.values()))
    names = list(rates)
    print(f"\nA. the step's matrix products on this CPU ({first.cpu}, {first.threads} threads), GFLOP/s, best of "
          "each call")
    print(f"{'count':>5} {'product':>34} {'GFLOP':>7} " + " ".join(f"{n:>7}" for n in names))
    for i, (g, _) in enumerate(first.gemms):
        cells = " ".join(f"{rates[n].gemms[i][1] / 1e9:>7.1f}" for n in names)
        print(f"{g.count:>5} {g.label():>34} {g.flops / 1e9:>7.3f} {cells}")
    print(f"{'':>5} {'the step (FLOP-weighted harmonic mean)':>42} " +
          " ".join(f"{rates[n].rate / 1e9:>7.1f}" for n in names))
    for n, r in rates.items():
        print(f"   {n}: {r.flops / 1e9:.2f} GFLOP of products per micro-batch, {r.seconds * 1e3:.0f} ms at these "
              f"rates; measured in {r.wall_s:.1f} s")


def bench_step(args, cfg, mc, precision: str) -> tuple[float, float, MicroShape]:
    """(best s/step, mean counted FLOPs per step, the median micro-batch's shape)."""
    import train_bench as tb

    cfg.train.max_steps = args.steps + 2
    steps = tb.micro_batches({"train_dir": args.train_dir}, cfg, mc, torch.device("cpu"))
    shapes = [[shape_of(mb) for mb in mbs] for mbs, _ in steps[2:]]
    flops = statistics.fmean(step_flops(mc, s, cfg.train.label_smoothing) for s in shapes)
    best = float("inf")
    for _ in range(args.repeats):
        tb.run_bare(steps[:2], cfg, mc, torch.device("cpu"), precision=precision)
        best = min(best, tb.run_bare(steps[2:], cfg, mc, torch.device("cpu"), precision=precision)["wall_s"])
    micro = sorted((m for s in shapes for m in s), key=lambda m: m.Mt)
    return best / args.steps, flops, micro[len(micro) // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/multi30k-tiny.toml")
    p.add_argument("--train-dir", required=True, help="an encode stage's train shards (the config's real batches)")
    p.add_argument("--steps", type=int, default=12, help="B: measured steps per run (after 2 warm-up steps)")
    p.add_argument("--repeats", type=int, default=3, help="B: best of; A: `cpu_rate.measure`'s own (5)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: a local run's CPU worker's)")
    p.add_argument("--dtypes", default="fp32,bf16")
    args = p.parse_args()
    cfg = load_config([args.config], [])
    mc = model_config_for(cfg, {"vocab_size": cfg.vocab.size})
    precision, threads = local_cpu_training(cfg)
    threads = args.threads or threads
    use_threads(threads)
    torch.set_flush_denormal(True)  # as the worker (pipeline.train.device.WorkerDevice)
    print(f"torch {torch.__version__}, {threads} threads, {args.config}: the step runs in {precision} here")
    s_per_step, flops, micro = bench_step(args, cfg, mc, precision)
    rates = {n: cpu_rate.measure(mc, micro, n, threads, cfg.train.label_smoothing)  # as --plan measures
             for n in args.dtypes.split(",")}
    print_rates(rates)
    achieved = flops / s_per_step
    print(f"\nB. the bare step in {precision} ({args.steps} real steps after 2 warm-up, best of {args.repeats}; "
          f"rates at the median micro-batch {micro})")
    print(f"   {s_per_step:.3f} s/step, {flops:.4e} counted FLOPs per step: {achieved / 1e9:.1f} GFLOP/s")
    for n, r in rates.items():
        print(f"   share of the {n} matmul rate ({r.rate / 1e9:.1f} GFLOP/s): {achieved / r.rate:.3f}; "
              f"the step at that rate: {flops / r.rate:.3f} s")


if __name__ == "__main__":
    main()
