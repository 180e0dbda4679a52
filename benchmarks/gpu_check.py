"""The GPU path, checked in one go (run by benchmarks/gpu_check.sh; <= 8 minutes on one GPU).

Prints one table:
- Transformer base train steps at 25k target tokens per step, bf16, eager and torch.compile'd
  (the real loop, `pipeline.train.loop.Trainer`, on synthetic shards with WMT14-like lengths):
  target tokens/s and MFU against the GPU's peak (--peak-flops; model FLOPs = 6 x the matmul
  parameters each real token passes through, attention scores left out, so MFU is a lower bound);
- host syncs per step (`torch.cuda.set_sync_debug_mode("warn")`) on plain steps, and on the step
  that logs and checkpoints;
- the loop's stall per checkpoint (`checkpoint.save` to local disk; the upload runs in the
  background with train.checkpoint_upload = "async");
- beam-4 decoding (alpha 0.6, max length input + 50) of 500 newstest2014-length sentences with a
  random base model, in sentences/s (a random model rarely stops early: a worst case).
Nothing is installed: it needs a Python whose torch sees the GPU (PYTHON=..., default .venv).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from model import ModelConfig, Transformer, beam_search  # noqa: E402
from pipeline.config import Config  # noqa: E402
from pipeline.train import checkpoint as train_checkpoint  # noqa: E402
from pipeline.train.loop import LocalSession, LoopSpec, Trainer  # noqa: E402
import scale_bench  # noqa: E402

VOCAB = 37000
DEVICE = "cuda:0"
TINY = False  # --smoke: a tiny model on CPU, to check this script itself where no GPU is at hand


def model_config() -> ModelConfig:
    if TINY:
        return ModelConfig(vocab_size=VOCAB, d_model=16, d_ff=32, n_heads=2, n_encoder_layers=1, n_decoder_layers=1)
    return ModelConfig.base(VOCAB)


def lengths(mirror: Path | None, rng: np.random.Generator, n: int = 30000) -> np.ndarray:
    """(n, 2) word counts: the mirror's real EN-DE pairs when present, else a lognormal fit of them."""
    if mirror is not None and mirror.is_dir():
        return scale_bench.mirror_lengths(mirror)
    w = np.exp(rng.normal(2.95, 0.75, size=n))  # mean ~22 words, the mirror's shape (stated)
    return np.stack([w, w * rng.uniform(0.8, 1.2, size=n)], 1).clip(1, 200).astype(np.int64)


def model_flops_per_step(mc: ModelConfig, src_tokens: int, tgt_tokens: int) -> float:
    d, f, V = mc.d_model, mc.d_ff, mc.vocab_size
    enc_layer = 4 * d * d + 2 * d * f
    dec_layer = 8 * d * d + 2 * d * f  # self-attn q/k/v/o + cross q/o + cross k/v (per source token, ~same)
    return 6.0 * (src_tokens * mc.n_encoder_layers * enc_layer + tgt_tokens * mc.n_decoder_layers * dec_layer
                  + tgt_tokens * d * V)


def train_run(train_dir: Path, work: Path, steps: int, compile_: bool) -> tuple[dict, Trainer]:
    cfg = Config()
    t = cfg.train
    t.max_steps, t.tokens_per_step, t.max_tokens_per_batch = steps, 25000, 25000
    t.log_interval_steps = steps // 2  # the second window is warm (compiled graphs, allocator)
    t.checkpoint_interval_steps = t.eval_interval_steps = 10**9
    t.precision, t.compile, t.corpus_cache_dir = "bf16", compile_, str(work / "cache")
    mc = model_config()
    spec = LoopSpec(cfg=cfg.to_dict(), model_config=mc.to_dict(), train_dir=str(train_dir))
    trainer = Trainer(spec, LocalSession(work / f"ckpt-{compile_}-{time.time_ns()}", device=DEVICE))
    trainer.tc.checkpoint_interval_steps = steps  # one checkpoint, at the end
    summary = trainer.run()
    return summary, trainer


def count_syncs(trainer: Trainer, steps: int) -> tuple[float, int]:
    """(syncs per plain step, syncs of the final step, which logs and checkpoints) of a short
    continued run; each step's count runs from its start to the next step's start."""
    trainer.tc.max_steps = trainer.progress.step + steps
    trainer.tc.log_interval_steps = trainer.tc.checkpoint_interval_steps = steps
    starts: list[int] = []
    original = trainer._train_step

    def marked(*a, **kw):
        starts.append(len(caught))
        return original(*a, **kw)

    trainer._train_step = marked
    if DEVICE.startswith("cuda"):
        torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.run()
            end = len(caught)
    finally:
        if DEVICE.startswith("cuda"):
            torch.cuda.set_sync_debug_mode("default")
        trainer._train_step = original
    per_step = np.diff(starts + [end])
    return float(per_step[:-1].mean()), int(per_step[-1])


def decode(n: int, rng: np.random.Generator, words: np.ndarray) -> float:
    mc = model_config()
    torch.manual_seed(0)
    model = Transformer(mc).to(DEVICE).eval()
    lens = (words[rng.integers(0, len(words), n), 0] * 1.3).astype(int).clip(1, 200)
    srcs = [rng.integers(4, VOCAB, size=k).tolist() + [mc.eos_id] for k in lens]
    order = np.argsort([len(s) for s in srcs])
    t0 = time.perf_counter()
    with torch.no_grad(), torch.autocast(DEVICE.split(":")[0], dtype=torch.bfloat16, enabled=not TINY):
        for i in range(0, n, 64):
            batch = [srcs[j] for j in order[i:i + 64]]
            width = max(len(s) for s in batch)
            src = torch.tensor([s + [mc.pad_id] * (width - len(s)) for s in batch], device=DEVICE)
            beam_search(model, src, beam_size=4, alpha=0.6)
    if DEVICE.startswith("cuda"):
        torch.cuda.synchronize()
    return n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peak-flops", type=float, default=989e12, help="bf16 dense peak (H200/H100 SXM: 989e12)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--decode-sentences", type=int, default=500)
    ap.add_argument("--mirror", default=os.environ.get("WMT14_MIRROR", str(REPO.parent / "shared/data/statmt-mirror")))
    ap.add_argument("--json")
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU: checks the script, measures nothing")
    args = ap.parse_args()
    global DEVICE, TINY
    if args.smoke:
        DEVICE, TINY = "cpu", True
    elif not torch.cuda.is_available():
        sys.exit("gpu_check needs a CUDA GPU (or --smoke)")
    rng = np.random.default_rng(0)
    words = lengths(Path(args.mirror), rng)
    rows: list[tuple[str, str]] = [("device", torch.cuda.get_device_name() if not TINY else "cpu (smoke)"),
                                   ("torch", torch.__version__)]
    res: dict = {}
    failed = []

    def section(name: str, fn) -> None:
        """Run one check; a failure is a row of the table (and a non-zero exit), not the end."""
        t0 = time.perf_counter()
        try:
            rows.extend(fn())
        except Exception as e:  # noqa: BLE001 (report every check)
            failed.append(name)
            rows.append((name, f"FAILED after {time.perf_counter() - t0:.0f} s: {type(e).__name__}: {e}"))

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        scale_bench.BENCH_VOCAB = VOCAB  # real vocabulary ids for the base model
        train_dir = scale_bench.write_corpus(work / "corpus", 200_000 if not TINY else 5000, words)
        mc = model_config()

        def train_section(compile_: bool):
            label = "compiled" if compile_ else "eager"
            t0 = time.perf_counter()
            summary, trainer = train_run(train_dir, work, args.steps, compile_)
            tps = trainer.last_metrics["train/tgt_tokens_per_s"]
            src_per_tgt = summary["tokens_seen"]["src"] / max(summary["tokens_seen"]["tgt"], 1)
            mfu = 100 * model_flops_per_step(mc, int(25000 * src_per_tgt), 25000) * tps / 25000 / args.peak_flops
            res[label] = {"tgt_tokens_per_s": tps, "mfu_pct": mfu, "wall_s": time.perf_counter() - t0}
            out = [(f"train base bf16 {label}", f"{tps:,.0f} tgt tok/s, MFU {mfu:.1f}% "
                    f"({time.perf_counter() - t0:.0f} s incl. start-up/compile)")]
            if not compile_:
                plain, last = count_syncs(trainer, 10)
                res["syncs_per_plain_step"], res["syncs_on_log_checkpoint_step"] = plain, last
                out += [("host syncs per plain step", f"{plain:.2f}"), ("host syncs on a log+checkpoint step", str(last))]
                folder = work / "ckpt-stall"
                folder.mkdir()
                t1 = time.perf_counter()
                train_checkpoint.save(folder, model=trainer.model, optimizer=trainer.optimizer,
                                      scheduler=trainer.scheduler, scaler=None, progress=trainer.progress,
                                      model_config=mc.to_dict())
                stall, size = time.perf_counter() - t1, sum(f.stat().st_size for f in folder.iterdir())
                res["checkpoint_stall_s"], res["checkpoint_bytes"] = stall, size
                out.append(("checkpoint stall (save; upload async)", f"{stall:.2f} s for {size / 2**20:.0f} MiB"))
            del trainer
            if not TINY:
                torch.cuda.empty_cache()
            return out

        section("train base bf16 eager", lambda: train_section(False))
        section("train base bf16 compiled", lambda: train_section(True))

        def decode_section():
            sps = decode(args.decode_sentences, rng, words)
            res["beam4_sentences_per_s"] = sps
            return [(f"beam-4 decode, {args.decode_sentences} sentences, random base", f"{sps:.1f} sentences/s")]

        section("beam-4 decode", decode_section)
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{width}}  {v}" for k, v in rows))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    if failed:
        sys.exit(f"gpu_check: {len(failed)} check(s) failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
