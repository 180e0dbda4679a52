"""The loss and dropout of a CPU training step: ours vs PyTorch's, and the whole step with each.

    .venv/bin/python benchmarks/cpu_step_bench.py [--threads 2] [--repeats 5] [--steps 12]
        [--train-dir work/multi30k/encode/<key>/train]

A. loss, forward + backward, on (M, K) logits of both dtypes: PyTorch's
   `F.cross_entropy(label_smoothing=0.1)` (what one would write), ours in one piece
   (`cpu_chunk_elements` past M * K: the whole logits copied to fp32, several passes over them), ours
   in row chunks of `model.training.CPU_CHUNK_ELEMENTS` (the default on a CPU). The gradients' largest error of ours and
   of PyTorch's fp32 loss against PyTorch's loss in fp64 (bf16 logits: the gradient's bf16 rounding).
B. dropout, forward + backward, on the residual stream's (M, d): `F.dropout` vs
   `model.compute.Dropout` (four 15-bit uniforms per 64-bit draw).
C. the bare training step (forward, loss, backward, Adam) of the two Multi30k models
   (configs/multi30k-fast.toml's d_model 256 / 3+3 at ~2700 target tokens, configs/multi30k-tiny.toml's
   d_model 128 / 4+4 at ~6800) under `speed.precision = auto`: "plain" (one-piece loss, PyTorch's
   dropout: `Transformer(cpu_kernels=False)`) vs "ours" (the defaults), alternating, best of --repeats. On real Multi30k batches with
   --train-dir (an encode stage's train shards), else the synthetic reverse task with Multi30k's lengths.

Sizes are the product's: K = 8000 (the Multi30k vocabulary), M = 2700 and 6800 target tokens per step.
Run it alone: on 2 cores another torch job makes every figure worthless.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys
import tempfile
import time
import types
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import model.training as model_training  # noqa: E402
from model import ModelConfig, label_smoothed_nll  # noqa: E402
from model.compute import Dropout  # noqa: E402
from pipeline.cpu_threads import use_threads  # noqa: E402
from pipeline.train import step as train_step  # noqa: E402

K = 8000
SIZES = {"multi30k-fast": dict(d_model=256, d_ff=1024, layers=3, tokens=2700, dropout=0.1),
         "multi30k-tiny": dict(d_model=128, d_ff=256, layers=4, tokens=6800, dropout=0.3)}


ONE_PIECE = 1 << 62  # cpu_chunk_elements past any M * K: the loss in one piece


@contextlib.contextmanager
def one_piece_step_loss(on: bool):
    """While `on`, the training step's loss (`pipeline.train.step.micro_batch_loss`) in one piece:
    this benchmark's A/B switch, not a setting of the product."""
    if not on:
        yield
        return
    with mock.patch.object(train_step, "label_smoothed_nll",
                           functools.partial(label_smoothed_nll, cpu_chunk_elements=ONE_PIECE)):
        yield


def best_ms(fn, repeats: int, inner: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - t0) / inner)
    return 1e3 * best


def bench_loss(repeats: int) -> None:
    print("\nA. label-smoothed loss, forward + backward, K = 8000 (ms, best of %d)" % repeats)
    print(f"{'M':>6} {'logits':>8} {'PyTorch F.cross_entropy':>24} {'ours, one piece':>16} {'ours, chunks':>13} "
          f"{'PyTorch/chunks':>15} {'one piece/chunks':>17} {'max err ours':>13} {'max err PyTorch':>16}")
    for M in (2700, 6800):
        for dtype in (torch.bfloat16, torch.float32):
            g = torch.Generator().manual_seed(0)
            logits = (3 * torch.randn(M, K, generator=g)).to(dtype)
            target = torch.randint(1, K, (M,), generator=g)
            target[::9] = 0

            def torch_ref():
                x = logits.detach().requires_grad_()
                F.cross_entropy(x.float(), target, ignore_index=0, label_smoothing=0.1, reduction="sum").backward()
                return x.grad

            def ours(chunk_elements: int = model_training.CPU_CHUNK_ELEMENTS):
                x = logits.detach().requires_grad_()
                label_smoothed_nll(x, target, epsilon=0.1, cpu_chunk_elements=chunk_elements)[0].backward()
                return x.grad

            one = best_ms(lambda: ours(ONE_PIECE), repeats)
            chunks = best_ms(ours, repeats)
            ref = best_ms(torch_ref, repeats)
            x64 = logits.double().requires_grad_()  # the reference: PyTorch's loss in fp64
            F.cross_entropy(x64, target, ignore_index=0, label_smoothing=0.1, reduction="sum").backward()
            err_ours = (ours().double() - x64.grad).abs().max().item()
            err_torch = (torch_ref().double() - x64.grad).abs().max().item()
            print(f"{M:>6} {str(dtype).split('.')[1]:>8} {ref:>24.1f} {one:>16.1f} {chunks:>13.1f} "
                  f"{ref / chunks:>14.2f}x {one / chunks:>16.2f}x {err_ours:>13.1e} {err_torch:>16.1e}")


def bench_dropout(repeats: int) -> None:
    print("\nB. dropout, forward + backward (ms, best of %d)" % repeats)
    print(f"{'shape':>12} {'dtype':>8} {'p':>4} {'F.dropout':>10} {'ours':>7} {'F.dropout/ours':>15}")
    for shape, p in (((2700, 256), 0.1), ((6800, 128), 0.3)):
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.randn(*shape, dtype=dtype, requires_grad=True)
            g = torch.randn(*shape, dtype=dtype)
            drop = Dropout(p).train()
            ref = best_ms(lambda: F.dropout(x, p, training=True).backward(g), repeats)
            ours = best_ms(lambda: drop(x).backward(g), repeats)
            print(f"{str(shape):>12} {str(dtype).split('.')[1]:>8} {p:>4} {ref:>10.2f} {ours:>7.2f} {ref / ours:>14.2f}x")


def bench_steps(args) -> None:
    import train_bench as tb

    print(f"\nC. the bare training step, speed.precision = auto ({args.steps} steps after 2 warm-up, "
          f"best of {args.repeats}, alternating; {'real batches: ' + args.train_dir if args.train_dir else 'synthetic reverse task'})")
    print(f"{'model':>14} {'tgt tok/step':>12} {'plain s/step':>14} {'ours s/step':>13} {'plain tok/s':>13} "
          f"{'ours tok/s':>12} {'ours/plain':>13}")
    with tempfile.TemporaryDirectory() as tmp:
        for name, s in SIZES.items():
            a = types.SimpleNamespace(rows=30000, vocab=K, max_len=28, d_model=s["d_model"], layers=s["layers"],
                                      steps=args.steps + 2, tokens_per_step=s["tokens"],
                                      max_tokens_per_batch=s["tokens"], precision="auto")
            spec, cfg, _ = tb.build(a, Path(tmp) / name, args.train_dir)
            cfg.train.max_len = 128
            mc = ModelConfig(vocab_size=K, d_model=s["d_model"], d_ff=s["d_ff"], n_heads=4,
                             n_encoder_layers=s["layers"], n_decoder_layers=s["layers"], dropout=s["dropout"])
            steps = tb.micro_batches(spec, cfg, mc, torch.device("cpu"))
            best = {True: None, False: None}
            for _ in range(args.repeats):
                for plain in (True, False):
                    with one_piece_step_loss(plain):
                        tb.run_bare(steps[:2], cfg, mc, torch.device("cpu"), cpu_kernels=not plain)
                        r = tb.run_bare(steps[2:], cfg, mc, torch.device("cpu"), cpu_kernels=not plain)
                    if best[plain] is None or r["wall_s"] < best[plain]["wall_s"]:
                        best[plain] = r
            b, n = best[True], best[False]
            per = args.steps
            print(f"{name:>14} {b['tgt_tokens'] / per:>12.0f} {b['wall_s'] / per:>14.3f} {n['wall_s'] / per:>13.3f} "
                  f"{b['tgt_tokens_per_s']:>13.0f} {n['tgt_tokens_per_s']:>12.0f} "
                  f"{n['tgt_tokens_per_s'] / b['tgt_tokens_per_s']:>12.2f}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: all CPUs)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=12, help="C: measured steps per run")
    p.add_argument("--train-dir", default="", help="C: an encode stage's train shards (real Multi30k batches)")
    p.add_argument("--only", choices=["loss", "dropout", "steps"], default=None)
    args = p.parse_args()
    if args.threads:
        use_threads(args.threads)
    torch.set_flush_denormal(True)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"CPU_CHUNK_ELEMENTS = {model_training.CPU_CHUNK_ELEMENTS}")
    if args.only in (None, "loss"):
        bench_loss(args.repeats)
    if args.only in (None, "dropout"):
        bench_dropout(args.repeats)
    if args.only in (None, "steps"):
        bench_steps(args)


if __name__ == "__main__":
    main()
