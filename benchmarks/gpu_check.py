"""The GPU path, checked in one go (run by benchmarks/gpu_check.sh; <= 8 minutes on one GPU).

Needs only torch >= 2.11 (CUDA build), numpy, pyarrow and sentencepiece on Python >= 3.11: no Ray,
MLflow, sacremoses, CTranslate2, transformers or FastAPI (tests/unit/core/test_gpu_check_smoke.py
runs `--smoke` with those made unimportable). Each section has a time budget (SIGALRM ends a
section that overruns it); a section that cannot run says why. Prints a table and writes JSON:

- train base / big, bf16, eager and torch.compile'd: the real loop (`pipeline.train.loop.Trainer`)
  on synthetic shards with WMT14-like lengths at 25k target tokens per step, accum 1: target
  tokens/s of the second (warm) half and MFU against --peak-flops, twice: `mfu_pct` (model FLOPs =
  6 x the matmul parameters each real token passes through, attention scores left out: a lower
  bound) and `mfu_counted_pct` (FLOPs counted by torch's FlopCounterMode on the steps measured,
  pipeline/plan/flops.py: the MFU `--plan --mfu-from gpu_check.json` bills with); compiled rows
  also give `compiled_graphs`, the graphs torch.compile built (first compile + recompiles +
  graph-break pieces; pipeline/train/device.py): a count that grows with the steps would mean a
  recompile per batch shape;
- host syncs per step (`torch.cuda.set_sync_debug_mode("warn")`), plain and log+checkpoint steps;
- the loop's stall per checkpoint (`checkpoint.save` to local disk; uploads run in the background);
- the largest `speed.max_tokens_per_batch` that fits for base and big: a fwd + bwd + Adam step on
  micro-batches of pairs at train.max_len (256 pieces, the worst case), grown until out of memory;
- DDP on one GPU (NCCL, world size 1, the bf16 gradient-compression hook): the loop's step through
  `pipeline.train.step.distributed(always=True)`, tokens/s vs the plain model;
- beam-4 decoding (alpha 0.6, max length input + 50) of newstest2014-length sentences with a
  random base model (a random model rarely stops early: a worst case), then, on one batch, the aten
  ops and the waits for the device per decoding step (what bounds a small model's search);
- CTranslate2 decoding: named as skipped when `ctranslate2` is absent.

`--smoke`: tiny models on the CPU, small budgets, every section's code path in well under a
minute; it measures nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import platform
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from model import ModelConfig  # noqa: E402
from pipeline.batch_plan import step_groups  # noqa: E402
from pipeline.config import Config  # noqa: E402
from pipeline.plan.flops import MicroShape, count_step_flops  # noqa: E402
from pipeline.train.loop import LocalSession, LoopSpec, Trainer  # noqa: E402
import scale_bench  # noqa: E402
from gpu_sections import (checkpoint_stall, count_syncs, ddp_section, decode_section, fit_section,  # noqa: E402
                          step_profile)

TOTAL_BUDGET_S = 560  # gpu_check.sh kills at 590 s; this leaves time to write the table and JSON
# --smoke with a bundle: the recipe's code path in a few tiny steps on the CPU.
SMOKE_MULTI30K = {"train": {"max_steps": 4}, "checkpoint": {"interval_steps": 2}, "speed": {"precision": "fp32"},
                  "metrics": {"val_loss_interval_steps": 2, "log_interval_steps": 2},
                  "decode": {"beam_size": 2, "max_len_b": 5}, "score": {"max_sentences": 20},
                  "model": {"d_model": 16, "d_ff": 32, "n_heads": 2, "n_encoder_layers": 1, "n_decoder_layers": 1}}


class Profile:
    """Sizes and budgets: the real ones on a GPU, tiny ones for --smoke on a CPU."""

    def __init__(self, smoke: bool):
        self.smoke = smoke
        self.device = "cpu" if smoke else "cuda:0"
        self.vocab = 300 if smoke else 37000
        self.tokens_per_step = 600 if smoke else 25000
        # Steady state: the last `measured_steps` of each train row, every step a fresh group of
        # real-length pairs (200k pairs; base's 200 steps x 25k tokens see ~180k of them once).
        self.measured_steps = 2 if smoke else 100
        self.train_steps = {"base": 4, "big": 4} if smoke else {"base": 200, "big": 200}
        self.corpus_pairs = 3000 if smoke else 200_000
        self.max_len = 256
        self.fit_range = (600, 1200) if smoke else (25000, 2_000_000)  # max_tokens_per_batch search
        self.decode_sentences = 8 if smoke else 500
        self.compile_backend = "eager" if smoke else "inductor"  # smoke: dynamo's capture only
        # Seconds per section on a GPU; --smoke has none (it checks code paths on a CPU that may be busy).
        self.budget = {k: (None if smoke else float(v)) for k, v in {
            "train base eager": 60, "host syncs": 20, "step profile": 30, "checkpoint stall": 20, "fit base": 40,
            "ddp nccl": 30, "beam-4 decode": 40, "train base compiled": 90, "train big eager": 60,
            "fit big": 40, "train big compiled": 100, "multi30k tiny recipe": 180}.items()}

    def model(self, size: str) -> ModelConfig:
        if self.smoke:
            d = 16 if size == "base" else 32
            return ModelConfig(vocab_size=self.vocab, d_model=d, d_ff=2 * d, n_heads=2, n_encoder_layers=1,
                               n_decoder_layers=1, max_positions=self.max_len + 2)
        return ModelConfig.base(self.vocab) if size == "base" else ModelConfig.big(self.vocab)


class _Overrun(Exception):
    pass


@contextlib.contextmanager
def alarm(seconds: float):
    """Raise _Overrun in the main thread after `seconds` (a section over its budget)."""
    def fire(*_):
        raise _Overrun(f"over its budget of {seconds:.0f} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


class Report:
    """Rows of the table and the JSON, one entry per section (ok, skipped with a reason, failed)."""

    def __init__(self, total_budget_s: float):
        self.t0, self.total = time.perf_counter(), total_budget_s
        self.sections: dict[str, dict[str, Any]] = {}
        self.rows: list[tuple[str, str]] = []

    def skip(self, name: str, reason: str) -> None:
        self.sections[name] = {"status": "skipped", "reason": reason}
        self.rows.append((name, f"SKIPPED: {reason}"))

    def run(self, name: str, budget_s: float | None, fn: Callable[[], tuple[dict, str]]) -> dict | None:
        """Run a section under its time budget (None: no budget, --smoke)."""
        left = self.total - (time.perf_counter() - self.t0)
        if budget_s is not None and left < budget_s:
            self.skip(name, f"not started: {left:.0f} s left of the {self.total:.0f} s budget, it needs up to "
                            f"{budget_s:.0f} s")
            return None
        t0 = time.perf_counter()
        try:
            with alarm(budget_s) if budget_s is not None else contextlib.nullcontext():
                figures, text = fn()
        except Exception as e:  # noqa: BLE001 (every section reports; one failure is not the end)
            self.sections[name] = {"status": "failed", "error": f"{type(e).__name__}: {e}",
                                   "wall_s": time.perf_counter() - t0, "budget_s": budget_s}
            self.rows.append((name, f"FAILED after {time.perf_counter() - t0:.0f} s: {type(e).__name__}: {e}"))
            return None
        wall = time.perf_counter() - t0
        self.sections[name] = {"status": "ok", "wall_s": wall, "budget_s": budget_s, **figures}
        self.rows.append((name, f"{text} ({wall:.0f} s)"))
        return figures


def model_flops_per_step(mc: ModelConfig, src_tokens: int, tgt_tokens: int) -> float:
    d, f, V = mc.d_model, mc.d_ff, mc.vocab_size
    enc_layer = 4 * d * d + 2 * d * f
    dec_layer = 8 * d * d + 2 * d * f  # self-attn q/k/v/o + cross q/o + cross k/v (per source token, ~same)
    return 6.0 * (src_tokens * mc.n_encoder_layers * enc_layer + tgt_tokens * mc.n_decoder_layers * dec_layer
                  + tgt_tokens * d * V)


def lengths(mirror: Path | None, rng: np.random.Generator, n: int = 30000) -> np.ndarray:
    """(n, 2) word counts: the mirror's real EN-DE pairs when present, else a lognormal fit of them."""
    if mirror is not None and mirror.is_dir():
        return scale_bench.mirror_lengths(mirror)
    w = np.exp(rng.normal(2.95, 0.75, size=n))  # mean ~22 words, the mirror's shape (stated)
    return np.stack([w, w * rng.uniform(0.8, 1.2, size=n)], 1).clip(1, 200).astype(np.int64)


def train(pr: Profile, size: str, compile_: bool, train_dir: Path, work: Path) -> tuple[dict, Trainer]:
    """The loop at 25k target tokens per step, accum 1; tokens/s of the second (warm) half."""
    cfg = Config()
    t, steps = cfg.train, pr.train_steps[size]
    t.max_steps, t.tokens_per_step = steps, pr.tokens_per_step
    cfg.speed.max_tokens_per_batch = 2 * pr.tokens_per_step  # a step's padded size: one micro-batch
    cfg.metrics.log_interval_steps = pr.measured_steps  # the last window: the measured steps
    cfg.checkpoint.interval_steps = cfg.metrics.val_loss_interval_steps = 10**9
    cfg.speed.precision, cfg.speed.compile, cfg.speed.compile_backend = "auto", compile_, pr.compile_backend
    cfg.workers.corpus_cache_dir = str(work / "cache")
    mc = pr.model(size)
    spec = LoopSpec(cfg=cfg.to_dict(), model_config=mc.to_dict(), train_dir=str(train_dir))
    trainer = Trainer(spec, LocalSession(work / f"ckpt-{size}-{compile_}", device=pr.device))
    summary = trainer.run()
    tps = trainer.metrics.last["train/tgt_tokens_per_s"]
    src_per_tgt = summary["tokens_seen"]["src"] / max(summary["tokens_seen"]["tgt"], 1)
    step_flops = model_flops_per_step(mc, int(pr.tokens_per_step * src_per_tgt), pr.tokens_per_step)
    return {"tgt_tokens_per_s": tps, "model_flops_per_step": step_flops, "precision": trainer.device_setup.precision,
            "params": sum(p.numel() for p in trainer.model.module.parameters()), "steps": steps,
            "counted_flops_per_tgt_token": counted_flops_per_tgt_token(trainer, mc, steps),
            "compiled_graphs": (trainer.device_setup.compiler.num_graphs if trainer.device_setup.compiler is not None
                                else None),
            "batch_shapes": summary["batch_shapes"], "measured_steps": pr.measured_steps}, trainer


def counted_flops_per_tgt_token(trainer: Trainer, mc: ModelConfig, steps: int, sample: int = 6) -> float:
    """FlopCounterMode's FLOPs per target token (pipeline/plan/flops.py, meta device) over up to
    `sample` of the measured (second-half) steps, split as the loop split them."""
    d, tc = trainer.train_data, trainer.tc
    plan = trainer.plan.groups(0)[steps - trainer.cfg.metrics.log_interval_steps:steps][:sample]
    micro = [[MicroShape.of(d.src_len[c], d.tgt_len[c]) for c in
              step_groups.split_step(g, d.src_len, d.tgt_len, 1, trainer.speed.max_tokens_per_batch).chunks[0] if len(c)]
             for g in plan]
    flops = sum(count_step_flops(mc, m, tc.label_smoothing) for m in micro)
    return flops / max(sum(x.Mt for m in micro for x in m), 1)


def present(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def environment(pr: Profile) -> dict:
    env = {"python": platform.python_version(), "torch": torch.__version__, "numpy": np.__version__,
           "device": "cpu (smoke)" if pr.smoke else torch.cuda.get_device_name(0),
           "optional": {m: present(m) for m in ("ctranslate2", "transformers", "ray", "mlflow")}}
    if not pr.smoke:
        props = torch.cuda.get_device_properties(0)
        env.update(cuda=torch.version.cuda, memory_gib=props.total_memory / 2**30,
                   bf16=torch.cuda.is_bf16_supported())
    return env


class Sections:
    """The sections' bodies, each returning (figures, table text). They share the run's profile, the
    synthetic corpus, and the trainer of "train base eager" (its tokens/s too), which the sections
    after it reuse until it is dropped (``held``)."""

    def __init__(self, pr: Profile, args: argparse.Namespace, work: Path, train_dir: Path):
        self.pr, self.args, self.work, self.train_dir = pr, args, work, train_dir
        self.held: dict[str, Any] = {}

    def train_row(self, size: str, compile_: bool) -> Callable[[], tuple[dict, str]]:
        """A train row: tokens/s and both MFUs; base eager's trainer is kept for the sections after it."""
        pr, args = self.pr, self.args

        def fn():
            res, trainer = train(pr, size, compile_, self.train_dir, self.work)
            res["mfu_pct"] = 100 * res["model_flops_per_step"] * res["tgt_tokens_per_s"] / pr.tokens_per_step \
                / args.peak_flops
            res["mfu_counted_pct"] = 100 * res["counted_flops_per_tgt_token"] * res["tgt_tokens_per_s"] \
                / args.peak_flops
            if size == "base" and not compile_:
                self.held["trainer"], self.held["tps"] = trainer, res["tgt_tokens_per_s"]
            else:
                del trainer
                _free(pr)
            graphs = f", {res['compiled_graphs']} compiled graph(s)" if compile_ else ""
            return res, (f"{res['tgt_tokens_per_s']:,.0f} tgt tok/s, MFU {res['mfu_pct']:.1f}% "
                         f"(counted FLOPs: {res['mfu_counted_pct']:.1f}%) ({res['precision']}, "
                         f"{res['params'] / 1e6:.0f}M params, last {res['measured_steps']} of {res['steps']} "
                         f"steps, {res['batch_shapes']} batch shapes{graphs})")
        return fn

    def needs_trainer(self, fn: Callable[[Trainer], tuple[dict, str]]) -> Callable[[], tuple[dict, str]]:
        """``fn`` on base eager's trainer; fails if that section did not finish."""
        def wrapped():
            if "trainer" not in self.held:
                raise RuntimeError("needs the 'train base eager' section's trainer, which did not finish")
            return fn(self.held["trainer"])
        return wrapped

    def drop_trainer(self) -> None:
        self.held.pop("trainer", None)
        _free(self.pr)

    def syncs(self, trainer: Trainer) -> tuple[dict, str]:
        plain, last = count_syncs(trainer, self.pr.device)
        note = "" if self.pr.device.startswith("cuda") else " (CPU: nothing to count)"
        return ({"syncs_per_plain_step": plain, "syncs_on_log_checkpoint_step": last},
                f"{plain:.2f} per plain step, {last} on a log+checkpoint step{note}")

    def profile(self, trainer: Trainer) -> tuple[dict, str]:
        r = step_profile(trainer, self.pr.device)
        gpu = (f", {r['launches_per_step']:.0f} kernel launches, device busy {r['device_ms_per_step']:.1f} ms"
               if "launches_per_step" in r else "")
        return r, f"{r['aten_ops_per_step']:.0f} aten ops per step, {r['wall_ms_per_step']:.1f} ms wall{gpu}"

    def stall(self, trainer: Trainer) -> tuple[dict, str]:
        r = checkpoint_stall(trainer, self.work / "ckpt-stall")
        return r, f"{r['checkpoint_stall_s']:.2f} s for {r['checkpoint_bytes'] / 2**20:.0f} MiB (save; upload async)"

    def ddp(self, trainer: Trainer) -> tuple[dict, str]:
        return ddp_section(self.pr, trainer, self.held["tps"])

    def multi30k(self) -> tuple[dict, str]:
        import gpu_multi30k

        overrides = SMOKE_MULTI30K if self.pr.smoke else None
        r = gpu_multi30k.run(Path(self.args.multi30k), self.pr.device, self.work / "multi30k", overrides)
        return r, (f"{r['steps']} steps in {r['train_s']:.1f} s ({r['ms_per_step']:.1f} ms/step, {r['precision']}, "
                   f"{r['batch_shapes']} batch shapes); last {len(r['averaged'])} averaged; beam {r['beam_size']} "
                   f"over {r['sentences']} test sentences in {r['decode_s']:.2f} s; BLEU4 {r['bleu4']:.2f}")


def run_sections(rep: Report, pr: Profile, args: argparse.Namespace, rng: np.random.Generator,
                 words: np.ndarray) -> None:
    """Every section in order, each under its budget: the ones on base eager's trainer right after it."""
    B = pr.budget
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        scale_bench.BENCH_VOCAB = pr.vocab  # real vocabulary ids for the models
        train_dir = scale_bench.write_corpus(work / "corpus", pr.corpus_pairs, words)
        sec = Sections(pr, args, work, train_dir)
        rep.run("train base eager", B["train base eager"], sec.train_row("base", False))
        rep.run("host syncs", B["host syncs"], sec.needs_trainer(sec.syncs))
        rep.run("step profile", B["step profile"], sec.needs_trainer(sec.profile))
        rep.run("checkpoint stall", B["checkpoint stall"], sec.needs_trainer(sec.stall))
        rep.run("ddp nccl", B["ddp nccl"], sec.needs_trainer(sec.ddp))
        sec.drop_trainer()
        rep.run("fit base", B["fit base"], lambda: fit_section(pr, "base"))
        rep.run("beam-4 decode", B["beam-4 decode"], lambda: decode_section(pr, rng, words))
        rep.run("train base compiled", B["train base compiled"], sec.train_row("base", True))
        rep.run("train big eager", B["train big eager"], sec.train_row("big", False))
        rep.run("fit big", B["fit big"], lambda: fit_section(pr, "big"))
        rep.run("train big compiled", B["train big compiled"], sec.train_row("big", True))
        if args.multi30k and (Path(args.multi30k) / "bundle.json").is_file():
            rep.run("multi30k tiny recipe", B["multi30k tiny recipe"], sec.multi30k)
        else:
            rep.skip("multi30k tiny recipe", f"no bundle at --multi30k {args.multi30k!r} (make one on a CPU machine: "
                                             "benchmarks/gpu_multi30k.py bundle)")
    if not present("ctranslate2"):
        rep.skip("ctranslate2 decode", "the ctranslate2 package is not installed here")
    else:
        rep.skip("ctranslate2 decode", "not implemented in gpu_check (it needs an exported model): run "
                                       "benchmarks/decode_bench.py --engines on a machine with the project's deps")


def write_report(rep: Report, env: dict, pr: Profile, args: argparse.Namespace) -> int:
    """The table on stdout, the JSON to --json; 1 if a section failed, else 0."""
    width = max(len(k) for k, _ in rep.rows)
    print(f"gpu_check: {env['device']}, torch {env['torch']}, Python {env['python']}"
          f"{', smoke (measures nothing)' if pr.smoke else ''}; {time.perf_counter() - rep.t0:.0f} s")
    print("\n".join(f"{k:<{width}}  {v}" for k, v in rep.rows))
    failed = [k for k, v in rep.sections.items() if v["status"] == "failed"]
    if args.json:
        Path(args.json).write_text(json.dumps({"env": env, "smoke": pr.smoke, "peak_flops": args.peak_flops,
                                               "wall_s": time.perf_counter() - rep.t0,
                                               "sections": rep.sections}, indent=2) + "\n")
    if failed:
        print(f"gpu_check: {len(failed)} section(s) failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peak-flops", type=float, default=989e12, help="bf16 dense peak (H200/H100 SXM: 989e12)")
    ap.add_argument("--mirror", default=os.environ.get("WMT14_MIRROR", str(REPO.parent / "shared/data/statmt-mirror")),
                    help="the WMT14 mirror for real sentence lengths (absent: a lognormal fit of them)")
    ap.add_argument("--json", default="gpu_check.json", help="where the JSON goes ('' = nowhere)")
    ap.add_argument("--budget", type=float, default=TOTAL_BUDGET_S, help="seconds for all sections together")
    ap.add_argument("--smoke", action="store_true", help="tiny models on the CPU: checks this script, measures nothing")
    ap.add_argument("--multi30k", default=str(REPO / ".gpu/multi30k"),
                    help="a bundle of benchmarks/gpu_multi30k.py: the Multi30k tiny recipe end to end (absent: skipped)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("gpu_check needs a CUDA GPU (or --smoke)", file=sys.stderr)
        return 2
    pr = Profile(args.smoke)
    rep = Report(args.budget)
    rng = np.random.default_rng(0)
    words = lengths(None if pr.smoke else Path(args.mirror), rng)
    env = environment(pr)
    run_sections(rep, pr, args, rng, words)
    return write_report(rep, env, pr, args)


def _free(pr: Profile) -> None:
    import gc

    gc.collect()
    if pr.device.startswith("cuda"):
        torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
