"""Training throughput: the stage's per-worker loop vs the bare model step on in-memory batches.

    .venv/bin/python benchmarks/train_bench.py [--steps 40] [--d-model 64] [--layers 2] [--threads 1]

A. loop:  `pipeline.train.loop.Trainer` with one in-process worker (no Ray), reading the encoded
          Parquet shards, planning token buckets, collating micro-batches, logging, checkpointing.
B. bare:  the same micro-batches (same rows, same shapes) collated before timing; the loop only
          runs forward, loss, backward, Adam, lr schedule.
C. loader alone: plan + split + collate for the same steps, no model.
D. with --ray (local mode as `make run` trains): the real `train` stage's Ray Train run on a
   local Ray with every CPU, once with `workers.cpus_per_worker = 1` (1 Ray CPU, so 1 torch
   thread) and once with 0 (auto: all of the node's CPUs), vs the bare step
   with all threads. Target: auto / bare >= 1.0.

Prints target tokens/s of A and B and the ratio A/B (target >= 0.9), and the loader's cost per
step. Synthetic "reverse" data with a WMT-like spread of lengths; `speed.precision` = --precision
(default auto: bf16 on a CPU with AVX512-BF16/AMX and on CUDA, else fp32).

E. --cpu-bf16: the bare step in fp32 and under bf16 autocast, side by side, at local size
   (d_model 128, 2+2 layers, vocab 4000, ~2500 target tokens) and at d_model 256, 3+3, vocab 8000
   (~2700 target tokens), and with --train-dir on local mode's real WMT batches; all threads;
   bf16 with each micro-batch's rows as they are and rounded up to 64 (what the loop does,
   `pipeline.train.device.row_multiple`); the ratio fp32 time / bf16 (x64) time.
F. --convergence STEPS: the loop (A) for STEPS steps at local size in fp32 and in bf16, the same
   seed and batches; dev loss and ppl of both (bf16 should be within a small margin of fp32).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests.support, when run as a script

from model import ModelConfig, Transformer, make_optimizer, make_scheduler  # noqa: E402
from pipeline.batch_plan import step_groups  # noqa: E402
from pipeline.train import feeder  # noqa: E402
from pipeline.train.feeder import BatchLayout, to_device  # noqa: E402
from pipeline.config import Config  # noqa: E402
from pipeline.cpu_threads import use_threads  # noqa: E402
from pipeline.train.corpus import load_corpus  # noqa: E402
from pipeline.train.loop import LocalSession, LoopSpec, Trainer  # noqa: E402
from pipeline.train.device import resolve_precision, row_multiple  # noqa: E402
from pipeline.train.step import LossSettings, accumulate_gradients, optimizer_step  # noqa: E402
from tests.support.synthetic import write_reverse_task  # noqa: E402


def build(args, work: Path, train_dir: str = "") -> tuple[dict, Config, ModelConfig]:
    """The bench's config and loop spec, on `train_dir`'s shards or a synthetic reverse task."""
    shards = train_dir or write_reverse_task(work / "train", args.rows, args.vocab, min_len=3,
                                             max_len=args.max_len, num_shards=4, seed=0)
    cfg = Config()
    m = cfg.model
    m.d_model, m.d_ff, m.n_heads = args.d_model, 4 * args.d_model, 4
    m.n_encoder_layers = m.n_decoder_layers = args.layers
    t = cfg.train
    cfg.workers.num_workers, t.max_steps = 1, args.steps
    t.tokens_per_step, cfg.speed.max_tokens_per_batch = args.tokens_per_step, args.max_tokens_per_batch
    cfg.metrics.log_interval_steps = cfg.metrics.val_loss_interval_steps = cfg.checkpoint.interval_steps = args.steps
    cfg.speed.precision = args.precision
    mc = ModelConfig(vocab_size=args.vocab, d_model=m.d_model, d_ff=m.d_ff, n_heads=m.n_heads,
                     n_encoder_layers=args.layers, n_decoder_layers=args.layers, dropout=m.dropout)
    spec = LoopSpec(cfg=cfg.to_dict(), model_config=mc.to_dict(), train_dir=str(shards)).to_dict()
    return spec, cfg, mc


def run_loop(spec: dict, work: Path, device: str) -> dict:
    trainer = Trainer(LoopSpec(**spec), LocalSession(work / "ckpt", device=device))
    t0 = time.perf_counter()
    out = trainer.run()
    if device == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    return {"tgt_tokens": out["tokens_seen"]["tgt"], "wall_s": wall,
            "tgt_tokens_per_s": out["tokens_seen"]["tgt"] / wall}


def micro_batches(spec: dict, cfg: Config, mc: ModelConfig, device: torch.device, multiple: int = 0):
    """Every step's micro-batches, as the loop would cut them, collated up front; their rows rounded
    up to `multiple` (0 = as the loop does in speed.precision on `device`: `device.row_multiple`)."""
    multiple = multiple or row_multiple(resolve_precision(cfg.speed.precision, device), device)
    d = load_corpus(spec["train_dir"])
    t = cfg.train
    rows = np.flatnonzero(step_groups.keep_mask(d.src_len, d.tgt_len, t.max_len))
    steps, epoch = [], 0
    while len(steps) < t.max_steps:
        for group in step_groups.plan_epoch(rows, d.src_len, d.tgt_len, t.tokens_per_step, t.seed, epoch):
            split = step_groups.split_step(group, d.src_len, d.tgt_len, 1, cfg.speed.max_tokens_per_batch)
            mbs = [to_device(feeder.collate(r, d, BatchLayout.of(mc, multiple)), device)
                   for r in split.for_worker(0)]
            steps.append((mbs, int(step_groups.target_tokens(d.tgt_len[group]).sum())))
            if len(steps) == t.max_steps:
                break
        epoch += 1
    return steps


def run_bare(steps, cfg: Config, mc: ModelConfig, device: torch.device, precision: str = "",
             cpu_kernels: bool = True) -> dict:
    """The bare step; `precision` "" = the loop's speed.precision resolved for `device`;
    `cpu_kernels`: the model's (`Transformer`'s)."""
    torch.manual_seed(cfg.train.seed)
    model = Transformer(mc, cpu_kernels=cpu_kernels).to(device)
    opt = make_optimizer(model)
    sched = make_scheduler(opt, mc.d_model, cfg.train.warmup_steps)
    precision = precision or resolve_precision(cfg.speed.precision, device)
    autocast = ((lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if precision == "bf16"
                else contextlib.nullcontext)
    t0 = time.perf_counter()
    tokens = 0
    for mbs, n_tgt in steps:
        accumulate_gradients(model, mbs, n_tgt, 1,
                             LossSettings(label_smoothing=cfg.train.label_smoothing, pad_id=mc.pad_id,
                                          autocast=autocast))
        optimizer_step(model, opt, sched, None, 0.0, want_norm=False)
        tokens += n_tgt
    if device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    return {"tgt_tokens": tokens, "wall_s": wall, "tgt_tokens_per_s": tokens / wall}


def run_loader(spec: dict, cfg: Config, mc: ModelConfig) -> dict:
    t0 = time.perf_counter()
    steps = micro_batches(spec, cfg, mc, torch.device("cpu"))
    wall = time.perf_counter() - t0
    return {"steps": len(steps), "wall_s": wall, "ms_per_step": 1000 * wall / len(steps)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--rows", type=int, default=20000)
    p.add_argument("--vocab", type=int, default=1000)
    p.add_argument("--max-len", type=int, default=60)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--tokens-per-step", type=int, default=4000)
    p.add_argument("--max-tokens-per-batch", type=int, default=2500)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=3, help="alternate loop/bare runs; the best of each is kept")
    p.add_argument("--json", default="", help="also write the figures here")
    p.add_argument("--ray", action="store_true", help="D: the train stage on a local Ray, 1 CPU vs all CPUs")
    p.add_argument("--ray-auto-only", action="store_true", help="D without the 1-CPU run")
    p.add_argument("--precision", default="auto", help="speed.precision of A, B and D (auto | bf16 | fp32)")
    p.add_argument("--cpu-bf16", action="store_true", help="E: fp32 vs bf16 bare steps on CPU at two sizes")
    p.add_argument("--train-dir", default="", help="E: also local mode's real batches: its encode stage's train "
                   "shards (after `make run ARGS=--to=encode`: work/local/encode/<key>/train)")
    p.add_argument("--convergence", type=int, default=0, metavar="STEPS",
                   help="F: dev loss after STEPS loop steps, fp32 vs bf16 (CPU)")
    args = p.parse_args()
    if args.ray:
        return ray_main(args)
    if args.cpu_bf16 or args.convergence:
        return cpu_bf16_main(args)
    use_threads(args.threads)
    logging.basicConfig(level=logging.WARNING)
    device = torch.device(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        spec, cfg, mc = build(args, work)
        loader = run_loader(spec, cfg, mc)
        steps = micro_batches(spec, cfg, mc, device)
        run_bare(steps[:3], cfg, mc, device)  # warm-up (allocator, kernels)
        loops, bares = [], []
        for i in range(args.repeats):  # alternate, so background load hits both alike
            loops.append(run_loop(spec, work / f"r{i}", args.device))
            bares.append(run_bare(steps, cfg, mc, device))
    loop = max(loops, key=lambda r: r["tgt_tokens_per_s"])
    bare = max(bares, key=lambda r: r["tgt_tokens_per_s"])
    ratio = loop["tgt_tokens_per_s"] / bare["tgt_tokens_per_s"]
    step_ms = 1000 * bare["wall_s"] / args.steps
    print(f"model d_model={args.d_model} layers={args.layers}+{args.layers} vocab={args.vocab}; "
          f"{args.steps} steps of ~{args.tokens_per_step} target tokens; device={args.device}, "
          f"threads={args.threads}")
    print(f"{'':28s}{'tgt tokens/s':>14s}{'wall s':>10s}")
    print(f"{'stage loop (data included)':28s}{loop['tgt_tokens_per_s']:14.0f}{loop['wall_s']:10.2f}")
    print(f"{'bare model step':28s}{bare['tgt_tokens_per_s']:14.0f}{bare['wall_s']:10.2f}")
    print(f"ratio loop / bare = {ratio:.3f} (target >= 0.9)")
    print(f"loader alone (plan + split + collate): {loader['ms_per_step']:.2f} ms/step "
          f"= {100 * loader['ms_per_step'] / step_ms:.1f}% of a bare step ({step_ms:.1f} ms)")
    if args.json:
        Path(args.json).write_text(json.dumps({"loop": loops, "bare": bares, "ratio": ratio,
                                               "loader": loader, "args": vars(args)}, indent=2))


def ray_main(args) -> None:
    """D: local-mode training through Ray Train (1 CPU per worker, and auto), the same loop
    in-process without Ray, and the bare step, all with every CPU; runs alternate and the best
    of --repeats is kept for each (one-off runs on a shared machine mostly measure the neighbours)."""
    import os

    from pipeline.ray_env import start_local_ray
    from pipeline.train.driver import fit

    cpus = os.cpu_count() or 1
    logging.basicConfig(level=logging.WARNING)
    start_local_ray(num_cpus=cpus, log_to_driver=False)
    use_threads(cpus)
    cpu = torch.device("cpu")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        spec, cfg, mc = build(args, work)
        cfg.workers.use_gpu = False
        cfg.metrics.log_interval_steps = args.steps // 2  # the second window: warm, and what is compared
        steps = micro_batches(spec, cfg, mc, cpu)
        run_bare(steps[:3], cfg, mc, cpu)
        modes = (("train stage, 1 CPU per worker", 1), ("train stage, auto (all CPUs)", 0))
        results: dict[str, list[float]] = {}
        for r in range(args.repeats):
            for label, n in modes[1:] if args.ray_auto_only else modes:
                cfg.workers.cpus_per_worker = n
                spec = {**spec, "cfg": cfg.to_dict()}
                result = fit(cfg, LoopSpec(**spec), f"bench-{n}-{r}", str(work / "ray_train"))
                results.setdefault(label, []).append(result.return_value["last_metrics"]["train/tgt_tokens_per_s"])
            trainer = Trainer(LoopSpec(**{**spec, "num_threads": cpus}), LocalSession(work / f"local-{r}"))
            trainer.run()
            results.setdefault("same loop in-process, no Ray", []).append(
                trainer.metrics.last["train/tgt_tokens_per_s"])
            results.setdefault("bare model step", []).append(
                run_bare(steps[args.steps // 2:], cfg, mc, cpu)["tgt_tokens_per_s"])
    best = {k: max(v) for k, v in results.items()}
    bare = best["bare model step"]
    print(f"local-mode training, {cpus} CPUs ({cpus} torch threads): model d_model={args.d_model} "
          f"layers={args.layers}+{args.layers}, ~{args.tokens_per_step} target tokens per step, "
          f"{resolve_precision(cfg.speed.precision, cpu)}; best of {args.repeats}, second half of {args.steps} steps")
    print(f"{'':42s}{'tgt tokens/s':>14s}{'/ bare':>8s}   all runs")
    for label, tps in best.items():
        runs = ", ".join(f"{x:.0f}" for x in results[label])
        print(f"{label:42s}{tps:14.0f}{tps / bare:8.2f}   {runs}")
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": results, "best": best, "cpus": cpus}, indent=2))

REAL = "local size, real WMT batches (--train-dir)"
SIZES = {"local (d_model 128, 2+2, vocab 4000)": dict(d_model=128, layers=2, vocab=4000, tokens_per_step=2500),
         "d_model 256, 3+3, vocab 8000": dict(d_model=256, layers=3, vocab=8000, tokens_per_step=2700)}


def cpu_bf16_main(args) -> None:
    """E and F: fp32 vs bf16 autocast on this CPU (all threads)."""
    import os

    from pipeline.train.device import cpu_bf16_features

    use_threads(os.cpu_count() or 1)
    logging.basicConfig(level=logging.WARNING)
    cpu = torch.device("cpu")
    features = cpu_bf16_features()
    print(f"CPU bf16 instructions: {', '.join(features) or 'none (bf16 is emulated: expect it slower)'}; "
          f"{torch.get_num_threads()} threads")
    out: dict = {"features": features, "threads": torch.get_num_threads()}
    if args.cpu_bf16:
        out["speed"] = {}
        print(f"{'bare step, fwd + bwd + Adam':44s}{'fp32 s/step':>12s}{'bf16, rows as is':>17s}"
              f"{'bf16, rows x64':>15s}{'fp32/bf16 x64':>14s}")
        sizes = dict(SIZES)
        if args.train_dir:
            sizes[REAL] = dict(d_model=128, layers=2, vocab=4000, tokens_per_step=2500)  # configs/local.toml
        for label, size in sizes.items():
            a = argparse.Namespace(**{**vars(args), **size, "max_tokens_per_batch": size["tokens_per_step"]})
            with tempfile.TemporaryDirectory() as tmp:
                spec, cfg, mc = build(a, Path(tmp), args.train_dir if label == REAL else "")
                cfg.train.max_len = 128 if label == REAL else cfg.train.max_len  # local.toml's
                as_is, x64 = micro_batches(spec, cfg, mc, cpu, 1), micro_batches(spec, cfg, mc, cpu, 64)
                runs = {"fp32": ("fp32", as_is), "bf16 as is": ("bf16", as_is), "bf16 x64": ("bf16", x64)}
            for precision, steps in runs.values():  # warm-up
                run_bare(steps[:2], cfg, mc, cpu, precision)
            best: dict[str, float] = {}
            for _ in range(args.repeats):  # alternate, so background load hits all alike
                for name, (precision, steps) in runs.items():
                    best[name] = min(best.get(name, math.inf), run_bare(steps, cfg, mc, cpu, precision)["wall_s"]
                                     / len(steps))
            out["speed"][label] = {**best, "ratio": best["fp32"] / best["bf16 x64"]}
            print(f"{label:44s}{best['fp32']:12.3f}{best['bf16 as is']:17.3f}{best['bf16 x64']:15.3f}"
                  f"{best['fp32'] / best['bf16 x64']:13.2f}x")
    if args.convergence:
        out["convergence"] = convergence(args, cpu)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


def convergence(args, cpu: torch.device) -> dict:
    """F: the loop at local size, fp32 then bf16, same seed and batches: dev loss of each."""
    size = SIZES["local (d_model 128, 2+2, vocab 4000)"]
    a = argparse.Namespace(**{**vars(args), **size, "steps": args.convergence,
                              "max_tokens_per_batch": size["tokens_per_step"]})
    res = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        spec, cfg, mc = build(a, work)
        dev = write_reverse_task(work / "dev", 500, a.vocab, min_len=3, max_len=a.max_len, num_shards=1, seed=1)
        cfg.train.warmup_steps = max(1, args.convergence // 3)
        cfg.metrics.val_loss_interval_steps = max(1, args.convergence // 4)
        for precision in ("fp32", "bf16"):
            cfg.speed.precision = precision
            trainer = Trainer(LoopSpec(**{**spec, "cfg": cfg.to_dict(), "dev_dir": str(dev)}),
                              LocalSession(work / precision, device="cpu"))
            t0 = time.perf_counter()
            summary = trainer.run()
            res[precision] = {"wall_s": time.perf_counter() - t0, "val_history": summary["history_val"],
                              "val_loss": summary["last_metrics"]["val/loss"],
                              "val_ppl": summary["last_metrics"]["val/ppl"]}
    f, b = res["fp32"], res["bf16"]
    print(f"convergence: {args.convergence} steps at local size (~{size['tokens_per_step']} target tokens/step, "
          f"warmup {cfg.train.warmup_steps}), reverse task, dev loss (label-smoothed) at each eval:")
    print(f"{'step':>6s}{'fp32':>10s}{'bf16':>10s}{'bf16-fp32':>11s}")
    for (step, lf, _), (_, lb, _) in zip(f["val_history"], b["val_history"]):
        print(f"{int(step):6d}{lf:10.4f}{lb:10.4f}{lb - lf:+11.4f}")
    print(f"final dev ppl: fp32 {f['val_ppl']:.3f}, bf16 {b['val_ppl']:.3f}; wall fp32 {f['wall_s']:.0f} s, "
          f"bf16 {b['wall_s']:.0f} s ({f['wall_s'] / b['wall_s']:.2f}x)")
    return res


if __name__ == "__main__":
    main()
