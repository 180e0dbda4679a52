"""What each row after 2017 costs per training step, beside the paper's post-norm model.

    .venv/bin/python benchmarks/later_rows_bench.py [--train-dir work/table3-later/encode/<key>/train]
        [--steps 3] [--repeats 2] [--threads 0]

The bare training step (forward, loss, backward, Adam; `benchmarks/train_bench.py`'s `run_bare`) of
configs/multi30k-fast.toml's model (d_model 256, d_ff 1024, 4 heads, 3+3 layers, 8000 pieces, ~2700
target tokens a step) with each `configs/table3/` row after 2017 applied to its `[model]`: the same
batches for every row, the rows alternating within each round, the best round kept, printed as
seconds per step and as the ratio to the paper's model. The Table 3 sweep's wall times come from
runs hours apart; this puts the rows' costs side by side in one run. Run it alone: on 2 cores
another torch job makes every figure worthless.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import tomllib
import types
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import train_bench as tb  # noqa: E402

from model import ModelConfig  # noqa: E402
from pipeline.cpu_threads import use_threads  # noqa: E402
from workflows.table3 import LATER  # noqa: E402

K, TOKENS = 8000, 2700


def row_model(row: str) -> ModelConfig:
    """configs/multi30k-fast.toml's model with the row's `[model]` keys (none for "base")."""
    options = {} if row == "base" else tomllib.loads((REPO / "configs" / "table3" / f"{row}.toml").read_text())["model"]
    return ModelConfig(vocab_size=K, d_model=256, d_ff=1024, n_heads=4, n_encoder_layers=3, n_decoder_layers=3,
                       dropout=0.1, **options)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--train-dir", default="", help="an encode stage's train shards (else a synthetic task)")
    p.add_argument("--steps", type=int, default=3, help="measured steps per row and round (after 2 warm-up)")
    p.add_argument("--repeats", type=int, default=2, help="rounds; the best of them is kept")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: all CPUs)")
    args = p.parse_args()
    if args.threads:
        use_threads(args.threads)
    torch.set_flush_denormal(True)
    rows = ["base", *LATER]
    device = torch.device("cpu")
    with tempfile.TemporaryDirectory() as tmp:
        a = types.SimpleNamespace(rows=30000, vocab=K, max_len=28, d_model=256, layers=3, steps=args.steps + 2,
                                  tokens_per_step=TOKENS, max_tokens_per_batch=TOKENS, precision="auto")
        spec, cfg, _ = tb.build(a, Path(tmp), args.train_dir)
        cfg.train.max_len = 128
        steps = tb.micro_batches(spec, cfg, row_model("base"), device)
        best: dict[str, float] = {}
        for _ in range(args.repeats):
            for row in rows:
                mc = row_model(row)
                tb.run_bare(steps[:2], cfg, mc, device)
                wall = tb.run_bare(steps[2:], cfg, mc, device)["wall_s"] / args.steps
                best[row] = min(best.get(row, wall), wall)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.steps} steps after 2 warm-up, "
          f"best of {args.repeats} alternating rounds; "
          f"{'real batches: ' + args.train_dir if args.train_dir else 'synthetic reverse task'}")
    print(f"{'row':>10} {'s/step':>8} {'/ base':>7}")
    for row in rows:
        print(f"{row:>10} {best[row]:>8.3f} {best[row] / best['base']:>6.2f}x")


if __name__ == "__main__":
    main()
