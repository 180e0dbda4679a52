"""torch.compile vs eager on this CPU: the training loop side by side, on token-bucketed batches.

    .venv/bin/python benchmarks/compile_bench.py [--steps 300] [--precision fp32|bf16|both]
        [--backend inductor] [--train-dir work/<...>/encode/<key>/train] [--threads 0] [--json FILE]

For each precision: the loop (`pipeline.train.loop.Trainer`, one in-process worker, no Ray) at
local mode's sizes (configs/local.toml: d_model 128, 2+2 layers, 2500 target tokens per step,
vocab 4000), eager and with `speed.compile = true`, the same seed and batches. Reported per
run: target tokens/s over the steps after the first log window (compilation is in the first
one), the wall time of that first window (compile time included), the graphs torch.compile built
(`pipeline.train.device`: first compile + recompiles + graph-break pieces) and the largest
relative difference of the logged losses (dropout masks equal: inductor's `fallback_random`).
With --train-dir, local mode's real batches (an encode stage's train split); else a synthetic
reverse task with lengths 1-80 pieces.

Results go to docs/benchmarks.md ("torch.compile on CPU"); nothing here is a timed test.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from model import ModelConfig  # noqa: E402
from pipeline.config import Config  # noqa: E402
from pipeline.cpu_threads import use_threads  # noqa: E402
from pipeline.train.loop import LocalSession, LoopSpec, Trainer  # noqa: E402
from tests.support.synthetic import write_reverse_task  # noqa: E402


def spec_for(args, train_dir: str, precision: str, compile_: bool) -> dict:
    cfg = Config()
    t, s = cfg.train, cfg.speed
    t.max_steps, t.tokens_per_step, s.max_tokens_per_batch = args.steps, 2500, 2500  # configs/local.toml
    t.warmup_steps, t.max_len, s.precision = 400, 128, precision
    cfg.metrics.log_interval_steps = args.window
    cfg.checkpoint.interval_steps = cfg.metrics.val_loss_interval_steps = 10**9
    s.compile, s.compile_backend = compile_, args.backend
    mc = ModelConfig(vocab_size=args.vocab, d_model=128, d_ff=512, n_heads=4, n_encoder_layers=2, n_decoder_layers=2,
                     dropout=0.1, max_positions=512)
    return LoopSpec(cfg=cfg.to_dict(), model_config=mc.to_dict(), train_dir=train_dir).to_dict()


def run(args, train_dir: str, precision: str, compile_: bool, work: Path) -> dict:
    torch._inductor.config.fallback_random = True  # the same dropout masks as eager
    torch._dynamo.reset()
    spec = spec_for(args, train_dir, precision, compile_)
    trainer = Trainer(LoopSpec(**spec), LocalSession(work / f"{precision}-{compile_}"))
    t0 = time.perf_counter()
    out = trainer.run()
    wall = time.perf_counter() - t0
    hist = out["history_train"]  # [step, loss, nll, lr] per window
    first = args.window
    tokens_after = out["tokens_seen"]["tgt"]  # the loop's own totals; the first window's share below
    step_times = trainer.metrics.last.get("train/step_time_s")
    return {"precision": out["precision"], "compile": compile_, "wall_s": wall, "losses": [h[1] for h in hist],
            "tgt_tokens": tokens_after, "last_window_tgt_tokens_per_s": trainer.metrics.last["train/tgt_tokens_per_s"],
            "last_window_step_time_s": step_times, "first_window_steps": first,
            "compiled_graphs": out["compiled_graphs"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--window", type=int, default=50, help="log window (the first one holds the compilation)")
    ap.add_argument("--precision", default="both", choices=("fp32", "bf16", "both"))
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--train-dir", default="", help="an encode stage's train split (default: synthetic)")
    ap.add_argument("--vocab", type=int, default=4000)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default: every core)")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    if args.threads:
        use_threads(args.threads)
    precisions = ["fp32", "bf16"] if args.precision == "both" else [args.precision]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        train_dir = args.train_dir or str(write_reverse_task(work / "train", 20000, args.vocab, min_len=1, max_len=80,
                                                              num_shards=2, seed=0))
        for precision in precisions:
            eager = run(args, train_dir, precision, False, work)
            compiled = run(args, train_dir, precision, True, work)
            diff = max(abs(a - b) / abs(a) for a, b in zip(eager["losses"], compiled["losses"]))
            rows.append({"precision": eager["precision"], "eager": eager, "compiled": compiled,
                         "max_rel_loss_diff": diff,
                         "speedup_last_window": compiled["last_window_tgt_tokens_per_s"]
                         / eager["last_window_tgt_tokens_per_s"]})
    print(f"compile_bench: {args.steps} steps, backend {args.backend}, {torch.get_num_threads()} thread(s), "
          f"torch {torch.__version__}, {'real batches from ' + args.train_dir if args.train_dir else 'synthetic'}")
    print(f"{'precision':<10} {'eager tok/s':>12} {'compiled tok/s':>15} {'speedup':>8} {'eager wall s':>13} "
          f"{'compiled wall s':>16} {'graphs':>7} {'max rel loss diff':>18}")
    for r in rows:
        e, c = r["eager"], r["compiled"]
        print(f"{r['precision']:<10} {e['last_window_tgt_tokens_per_s']:>12,.0f} "
              f"{c['last_window_tgt_tokens_per_s']:>15,.0f} {r['speedup_last_window']:>7.2f}x {e['wall_s']:>13.1f} "
              f"{c['wall_s']:>16.1f} {c['compiled_graphs']:>7} {r['max_rel_loss_diff']:>18.2e}")
    print("tok/s: the last log window's (after compilation); wall: the whole run, compilation included")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
