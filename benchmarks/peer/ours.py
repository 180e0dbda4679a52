"""Our side: workflows/reproduce_base.py up to ``score``, on the budget's steps, and its manifests."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from peer import REPO, log
from peer.report import sacre

SMOKE = {  # a tiny model on a slice of the data: proves the plumbing, not the numbers
    "vocab.size": 1000, "model.d_model": 64, "model.d_ff": 128, "model.n_heads": 2,
    "model.n_encoder_layers": 1, "model.n_decoder_layers": 1, "train.tokens_per_step": 800,
    "speed.max_tokens_per_batch": 1024, "train.warmup_steps": 100, "metrics.val_loss_interval_steps": 50,
    "metrics.log_interval_steps": 10, "data.max_pairs_per_corpus": 3000, "score.max_sentences": 40,
}
OUR_ECHO = re.compile(r"stage \w+: (done|running|cached)|step \d+/\d+ \||translate: \d+ / \d+|sacreBLEU|Error|error:"
                      r"|Traceback")


def our_overrides(args: argparse.Namespace, steps: int, ckpt: int) -> list[str]:
    """Our workflow's command-line overrides: data, work dir, steps, checkpoints (and --smoke's model)."""
    out = [f"--data.mirror={args.data_mirror}", f"--run.work_dir={args.work_dir}",
           f"--train.max_steps={steps}", f"--checkpoint.interval_steps={ckpt}"]
    if args.smoke:
        out += [f"--{k}={v}" for k, v in SMOKE.items()]
    return out


def run_logged(cmd: list[str], logfile: Path, cwd: Path, echo: re.Pattern | None = None) -> int:
    """Run `cmd`, its output to `logfile`, the lines matching `echo` to stdout."""
    logfile.parent.mkdir(parents=True, exist_ok=True)
    with logfile.open("w") as f:
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                bufsize=1)
        for line in proc.stdout:
            f.write(line)
            if echo is None or echo.search(line):
                print("    " + line.rstrip()[:220], flush=True)
        return proc.wait()


def run_ours(args: argparse.Namespace, steps: int, ckpt: int) -> dict[str, Any]:
    """Our workflow up to ``score``; its resolved config and the manifests of the stages compared."""
    from pipeline.config import load_config
    from pipeline.dag import keys_in_work_dir, read_manifest, stage_dir

    overrides = our_overrides(args, steps, ckpt)
    cmd = [sys.executable, "workflows/reproduce_base.py", "--config", str(args.config), "--to", "score", *overrides]
    log("ours: " + " ".join(cmd))
    t0 = time.monotonic()
    rc = run_logged(cmd, Path(args.work_dir) / "peer_eole.ours.log", REPO, OUR_ECHO)
    if rc != 0:
        raise SystemExit(f"our workflow failed (exit {rc}); see {Path(args.work_dir) / 'peer_eole.ours.log'}")
    cfg = load_config([args.config], overrides)
    keys = keys_in_work_dir(cfg)
    manifests = {}
    for stage in ("download", "prepare", "vocab", "train", "average", "translate", "score"):
        m = read_manifest(stage_dir(cfg, stage, keys[stage]), keys[stage])
        if m is None:
            raise SystemExit(f"ours: no manifest for stage {stage} (key {keys[stage]}) under {args.work_dir}")
        manifests[stage] = m
    log(f"ours: workflow done in {time.monotonic() - t0:.0f} s")
    return {"cfg": cfg, "manifests": manifests}


def score_ours(ours: dict[str, Any], refs: list[str]) -> dict[str, Any]:
    """Our train loop's seconds and target tokens, and our test translation's sacreBLEU against ``refs``."""
    man = ours["manifests"]
    tr = man["train"].outputs
    our_train_s = float(tr["wall_s"])
    our_tokens = float(tr["tokens_seen"]["tgt"])
    our_hyps = Path(man["translate"].outputs["splits"]["test"]["hyps"]).read_text(encoding="utf-8").splitlines()
    our_score = sacre(our_hyps, refs)
    log(f"ours: {tr['final_step']} steps in {our_train_s:.0f} s ({our_tokens / our_train_s:.0f} target tokens/s, "
        f"{tr.get('precision')}), sacreBLEU {our_score['bleu']:.2f}, translate {man['translate'].outputs['wall_s']:.1f} s")
    return {"train_s": our_train_s, "tokens": our_tokens, "score": our_score}
