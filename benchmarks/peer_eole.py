"""Ours vs eole 0.6.4 (the maintained OpenNMT-py successor), side by side.

The same model (d_model 256, d_ff 1024, 4 heads, 3+3 layers, one shared 8000-piece SentencePiece
vocabulary, dropout 0.1, label smoothing 0.1, Noam lr factor 2 with 1000 warmup steps, ~2700 target
tokens per step) on the same Multi30k task 1 EN->DE data (raw, cased), each side with the precision
that is fastest for it on this CPU (ours: speed.precision = "auto", bf16 on AVX512-BF16/AMX; eole:
fp32), for the same wall-clock training budget. Both average their last 5 checkpoints, decode
test_2016_flickr (1,000 sentences) with beam 4 and alpha 0.6 (GNMT length penalty), and are scored
with sacreBLEU (default settings) against the raw German reference.

    benchmarks/peer_eole.sh --budget-s 600 --out work/peer-eole/peer_eole.json

1. eole goes into its own venv (--eole-venv, default .venv-eole; never the project's): torch==2.13.0
   first, so pip takes the local CPU wheel, then eole==0.6.4 (checked not to replace torch).
2. Ours runs first: workflows/reproduce_base.py with configs/peer/multi30k-ende-256.toml up to
   `score`. Our train stage has no time limit, so train.max_steps is the budget over an estimated
   seconds per step (--our-sec-per-step, 1.25 s measured here at this size; or --our-steps); the
   train stage's own loop time (train manifest `wall_s`) is then the budget eole gets, to the second.
3. eole gets exactly our data and vocabulary: our prepare stage's pairs, cut into pieces by our
   vocab stage's spm.model (out_type=str), and a shared vocab file of the same 8000 pieces (eole's
   own <unk>/<blank>/<s>/</s> in place of SentencePiece's four specials). eole has no time limit:
   it trains with a huge train_steps, checkpoints every N steps (the same N as ours), and is stopped
   when its training loop (from its "Start training loop" line) has run our train seconds.
4. eole 0.6.4's wheel lacks `eole model average` (eole/bin/model/ is not packaged), so its last 5
   complete checkpoints are averaged here with that tool's own code (running mean of
   model.00.safetensors, config and vocab copied), in eole's venv. `eole predict` decodes the test
   pieces, which are decoded with the same spm model before scoring.

Differences that cannot be removed, printed with the table: eole has no post-norm decoder (its
decoder layer is pre-norm only; its encoder could be post-norm, which would mix the two), so eole
runs pre-norm and ours post-norm (the paper's). eole batches by padded max(src, tgt) tokens per
sentence, so its batch_size is set from the data to give ~2700 target tokens per step, and the
target tokens it actually trained on are read from its log. eole's decoder length cap is its own
default (max_length 250, max_length_ratio 2); ours is source length + 50.

This script holds the command line and the order of the steps; each step's code is in
benchmarks/peer/ (ours.py, eole_setup.py, eole_run.py, report.py).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from peer import log  # noqa: E402  (benchmarks/peer/, beside this script)
from peer.eole_run import run_eole  # noqa: E402
from peer.eole_setup import ensure_eole  # noqa: E402
from peer.ours import our_overrides, run_ours, score_ours  # noqa: E402
from peer.report import Sides, raw_refs, write_result  # noqa: E402

DEFAULT_CONFIG = REPO / "configs" / "peer" / "multi30k-ende-256.toml"
DEFAULT_MIRROR = (REPO / ".." / "shared" / "data" / "multi30k").resolve()
# Seconds per step of our train stage at this size on the 2-core CPU (a hand test here: 1100 steps
# in 23 min, bf16); --smoke's tiny model is much faster.
OUR_SEC_PER_STEP = 1.25
SMOKE_SEC_PER_STEP = 0.15


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget-s", type=float, required=True,
                   help="training wall-clock budget per side, seconds (ours: its max_steps is budget / "
                        "--our-sec-per-step; eole then gets our measured train loop time)")
    p.add_argument("--out", default="", help="JSON result (default <work-dir>/peer_eole.json)")
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    p.add_argument("--work-dir", default=str(REPO / "work" / "peer-eole"),
                   help="our run.work_dir; eole's files go to <work-dir>/eole")
    p.add_argument("--data-mirror", default=str(DEFAULT_MIRROR), help="the offline Multi30k folder (data.mirror)")
    p.add_argument("--eole-venv", type=Path, default=REPO / ".venv-eole")
    p.add_argument("--our-sec-per-step", type=float, default=0.0,
                   help=f"for train.max_steps from the budget (default {OUR_SEC_PER_STEP}; --smoke {SMOKE_SEC_PER_STEP})")
    p.add_argument("--our-steps", type=int, default=0, help="train.max_steps directly (overrides the estimate)")
    p.add_argument("--ckpt-steps", type=int, default=0,
                   help="checkpoint interval in steps, both sides (default: ~1/20 of our steps, so the last "
                        "5 averaged span the last quarter of training)")
    p.add_argument("--eole-batch-size", type=int, default=0,
                   help="eole's batch_size in its padded max(src, tgt) tokens (default: set from the data to "
                        "give our train.tokens_per_step target tokens per step)")
    p.add_argument("--eole-num-workers", type=int, default=1, help="eole's DataLoader workers")
    p.add_argument("--eole-dtype", default="fp32", choices=["fp32", "bf16"], help="eole's compute_dtype")
    p.add_argument("--eole-report-every", type=int, default=10)
    p.add_argument("--skip-eole-train", action="store_true",
                   help="reuse eole's checkpoints from a previous run of this script (ours is cached anyway)")
    p.add_argument("--smoke", action="store_true",
                   help="a tiny model on 3000 pairs, 40 test sentences: checks the plumbing only")
    args = p.parse_args(argv)
    args.work_dir = str(Path(args.work_dir).resolve())
    args.data_mirror = str(Path(args.data_mirror).resolve())
    args.out = args.out or str(Path(args.work_dir) / "peer_eole.json")
    args.our_sec_per_step = args.our_sec_per_step or (SMOKE_SEC_PER_STEP if args.smoke else OUR_SEC_PER_STEP)
    args.eole_venv = args.eole_venv.resolve() if args.eole_venv.is_absolute() else (Path.cwd() / args.eole_venv)
    return args


def plan_steps(args: argparse.Namespace, average_last: int) -> tuple[int, int]:
    """Our train.max_steps from the budget, and the checkpoint interval of both sides.

    About 20 checkpoints (so the last ``average_last`` averaged span the last quarter of training),
    and a number of steps that ends on a checkpoint."""
    steps = args.our_steps or max(10, int(args.budget_s / args.our_sec_per_step))
    ckpt = args.ckpt_steps or max(5, 5 * round(steps / 20 / 5))
    steps = max(ckpt * average_last, ckpt * round(steps / ckpt))  # the last step is a checkpoint
    log(f"budget {args.budget_s:.0f} s: ours trains {steps} steps (~{args.our_sec_per_step} s/step), "
        f"checkpoints every {ckpt} steps on both sides")
    return steps, ckpt


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_all = time.monotonic()
    versions = ensure_eole(args.eole_venv)

    from pipeline.config import load_config

    base = load_config([args.config], our_overrides(args, 1, 1))
    args.beam_size, args.alpha = base.decode.beam_size, base.decode.alpha
    steps, ckpt = plan_steps(args, base.average.checkpoints)

    # 1. ours
    ours = run_ours(args, steps, ckpt)
    n_test = ours["manifests"]["translate"].outputs["splits"]["test"]["num_sentences"]
    refs = raw_refs(ours, n_test)
    our = score_ours(ours, refs)
    # 2. eole, on the same pieces and vocabulary, for our train loop's seconds
    eole = run_eole(args, ours, refs, our["train_s"], ckpt)
    # 3. the table
    write_result(Sides(args=args, ours=ours, our=our, eole=eole, steps=steps, ckpt=ckpt), versions, t_all)
    return 0


if __name__ == "__main__":
    sys.exit(main())
