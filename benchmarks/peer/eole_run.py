"""eole's side, run: trained for our train loop's seconds, its last checkpoints averaged, decoded."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from peer import log
from peer.eole_setup import write_train_config
from peer.report import sacre

STARTUP_TIMEOUT_S = 900  # eole's imports, vocab and model build: ~20 s on an idle 2-core CPU
STEP_RE = re.compile(r"Step\s+(\d+)/\s*\d+;.*?bsz:\s*([\d.]+)/\s*([\d.]+)/\s*[\d.]+;\s*([\d.]+)/\s*([\d.]+) tok/s;"
                     r"\s*([\d.]+) sec")


class TrainLog:
    """eole's training log, parsed as it comes: when its loop started, and its step reports."""

    def __init__(self, t_start: float, report_every: int):
        self.t_start, self.report_every = t_start, report_every
        self.t_loop: float | None = None
        self.reports: list[tuple[float, ...]] = []

    def read(self, stream: Any, f: Any) -> None:
        """Copies ``stream`` to ``f``; echoes every 10th report, checkpoints, validations and errors."""
        for line in stream:
            f.write(line)
            f.flush()
            if self.t_loop is None and "Start training loop" in line:
                self.t_loop = time.monotonic()
                log(f"eole: training loop started ({self.t_loop - self.t_start:.1f} s after launch)")
            mt = STEP_RE.search(line)
            if mt:
                self.reports.append(tuple(float(x) for x in mt.groups()))
                if int(mt.group(1)) % (self.report_every * 10) == 0:
                    print("    " + line.strip()[:220], flush=True)
            elif "Saving optimizer and weights" in line or "Validation" in line or "Error" in line:
                print("    " + line.strip()[:220], flush=True)


def _stop_at_budget(proc: subprocess.Popen, train_log: TrainLog, budget_s: float) -> bool:
    """Waits for eole, stopping it once its loop has run ``budget_s`` (or it never starts one).

    SIGTERM first, SIGKILL 15 s later. True if this stopped it, False if it exited by itself."""
    stopped, t_stop = False, 0.0
    while proc.poll() is None:
        now = time.monotonic()
        if not stopped and train_log.t_loop is not None and now - train_log.t_loop >= budget_s:
            log(f"eole: budget of {budget_s:.0f} s spent: stopping it")
            _signal_group(proc.pid, signal.SIGTERM)
            stopped, t_stop = True, now
        elif stopped and now - t_stop > 15:
            _signal_group(proc.pid, signal.SIGKILL)
        elif not stopped and train_log.t_loop is None and now - train_log.t_start > STARTUP_TIMEOUT_S:
            log(f"eole: no training loop after {STARTUP_TIMEOUT_S} s: stopping it")
            _signal_group(proc.pid, signal.SIGKILL)
            stopped, t_stop = True, now
        time.sleep(0.1)
    return stopped


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)  # the group of the one eole process this script started
    except ProcessLookupError:
        pass


def train_eole(args: argparse.Namespace, venv: Path, yaml_path: Path, eole_dir: Path, budget_s: float,
               ckpt: int) -> dict[str, Any]:
    """Train until the training loop has run `budget_s` seconds, then stop eole."""
    model_dir = eole_dir / "model"
    if model_dir.exists():
        shutil.rmtree(model_dir)
    logfile = eole_dir / "train.log"
    cmd = [str(venv / "bin" / "eole"), "train", "-c", str(yaml_path)]
    log("eole: " + " ".join(cmd) + f" (stopped {budget_s:.0f} s after its training loop starts)")
    train_log = TrainLog(time.monotonic(), args.eole_report_every)
    with logfile.open("w") as f:
        # its own process group (start_new_session): stopped together with its DataLoader workers
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        thread = threading.Thread(target=train_log.read, args=(proc.stdout, f), daemon=True)
        thread.start()
        stopped = _stop_at_budget(proc, train_log, budget_s)
        thread.join(timeout=10)
    if not stopped:
        raise SystemExit(f"eole train exited by itself (code {proc.returncode}) before the budget; see {logfile}")
    if train_log.t_loop is None:
        raise SystemExit(f"eole never started its training loop; see {logfile}")
    if not train_log.reports:
        raise SystemExit(f"eole logged no training step; see {logfile}")
    return _train_result(train_log.reports, complete_checkpoints(model_dir), budget_s, logfile)


def _train_result(reports: list[tuple[float, ...]], ckpts: list[Path], budget_s: float,
                  logfile: Path) -> dict[str, Any]:
    """Steps, seconds and target tokens from eole's last report, and its complete checkpoints."""
    # Target tokens: each report line gives the mean target tokens per batch over its window.
    tokens, prev = 0.0, 0
    for step, _src_bsz, tgt_bsz, *_ in reports:
        tokens += tgt_bsz * (step - prev)
        prev = int(step)
    last_step, last_sec = int(reports[-1][0]), reports[-1][5]
    return {"steps_logged": last_step, "seconds_at_last_log": last_sec, "tgt_tokens": tokens,
            "tgt_tokens_per_s": tokens / max(last_sec, 1e-9), "tgt_tokens_per_step": tokens / max(last_step, 1),
            "last_logged_tok_s_tgt": reports[-1][4], "loop_s": budget_s, "checkpoints": [str(c) for c in ckpts],
            "checkpoint_steps": [int(c.name.split("_")[1]) for c in ckpts], "log": str(logfile)}


def complete_checkpoints(model_dir: Path) -> list[Path]:
    """step_N folders whose save finished (config.json is written after the weights), oldest first."""
    dirs = [d for d in model_dir.glob("step_*") if d.is_dir() and (d / "config.json").exists()
            and (d / "vocab.json").exists() and (d / "model.00.safetensors").exists()]
    return sorted(dirs, key=lambda d: int(d.name.split("_")[1]))


# eole/bin/model/average_models.py (`eole model average`) of the eole repository, which the 0.6.4
# wheel does not package: a running mean of the safetensors weights, config and vocab copied.
AVERAGE_CODE = r"""
import json, os, shutil, sys
from safetensors.torch import load_file, save_file
out, paths = sys.argv[1], sys.argv[2:]
avg = None
for i, p in enumerate(paths):
    w = load_file(os.path.join(p, "model.00.safetensors"))
    if avg is None:
        avg = {k: v.float().clone() for k, v in w.items()}
    else:
        for k in avg:
            avg[k].mul_(i).add_(w[k].float()).div_(i + 1)
os.makedirs(out, exist_ok=True)
for name in ("config.json", "vocab.json"):
    shutil.copy(os.path.join(paths[0], name), os.path.join(out, name))
save_file(avg, os.path.join(out, "model.00.safetensors"))
print(f"averaged {len(paths)} checkpoints into {out}")
"""

PREDICT_TIME_RE = re.compile(r"(Step 0 time \(s\)|Subsequent prediction time including all \(s\)): ([\d.]+)")


def predict_eole(args: argparse.Namespace, venv: Path, model: Path, src: str, out: Path, eole_dir: Path,
                 tag: str) -> dict[str, Any]:
    """``eole predict`` of ``src`` into ``out`` (beam and alpha as ours); its process and loop seconds."""
    cfg = {"model_path": str(model), "src": src, "output": str(out), "beam_size": args.beam_size,
           "length_penalty": "wu", "alpha": args.alpha, "world_size": 1, "gpu_ranks": [],
           "compute_dtype": args.eole_dtype, "report_time": True, "seed": 1234}
    yaml_path = eole_dir / f"predict.{tag}.yaml"
    yaml_path.write_text(json.dumps(cfg, indent=1))  # JSON is YAML
    cmd = [str(venv / "bin" / "eole"), "predict", "-c", str(yaml_path)]
    log(f"eole: {' '.join(cmd)}")
    t0 = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.monotonic() - t0
    (eole_dir / f"predict.{tag}.log").write_text(r.stdout + r.stderr)
    if r.returncode != 0:
        raise SystemExit(f"eole predict failed (exit {r.returncode}); see {eole_dir / f'predict.{tag}.log'}")
    loop = sum(float(m.group(2)) for m in PREDICT_TIME_RE.finditer(r.stdout + r.stderr))
    return {"process_wall_s": wall, "loop_s": loop or None}


def train_or_reuse(args: argparse.Namespace, yaml_path: Path, eole_dir: Path, budget_s: float,
                   ckpt: int) -> dict[str, Any]:
    """eole trained for ``budget_s``, or (--skip-eole-train) the result of a previous run."""
    result_file = eole_dir / "train_result.json"
    if args.skip_eole_train and result_file.exists():
        log(f"eole: reusing {result_file}")
        return json.loads(result_file.read_text())
    et = train_eole(args, args.eole_venv, yaml_path, eole_dir, budget_s, ckpt)
    result_file.write_text(json.dumps(et, indent=1))
    return et


def average_last(venv: Path, eole_dir: Path, checkpoints: list[str], n: int) -> tuple[Path, list[Path]]:
    """The last ``n`` complete checkpoints averaged in eole's venv; (the averaged folder, those checkpoints)."""
    last = [Path(c) for c in checkpoints][-n:]
    if len(last) < n:
        log(f"WARNING: eole kept only {len(last)} complete checkpoints; averaging those")
    avg_dir = eole_dir / "averaged"
    if avg_dir.exists():
        shutil.rmtree(avg_dir)
    subprocess.run([str(venv / "bin" / "python"), "-c", AVERAGE_CODE, str(avg_dir), *map(str, last)], check=True)
    return avg_dir, last


def decode_test(args: argparse.Namespace, data: dict[str, Any], eole_dir: Path, models: dict[str, Path],
                refs: list[str]) -> dict[str, dict[str, Any]]:
    """Each model's test translation (``eole predict`` on our pieces, decoded with our spm.model) and score."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=data["spm_model"])
    test_src = data["files"]["test.en"]
    decodes = {}
    for tag, model in models.items():
        pred = eole_dir / f"pred.{tag}.pieces"
        timing = predict_eole(args, args.eole_venv, model, test_src, pred, eole_dir, tag)
        hyps = [sp.decode(line.split()) for line in pred.read_text(encoding="utf-8").splitlines()]
        if len(hyps) != len(refs):
            raise SystemExit(f"eole predict wrote {len(hyps)} lines for {len(refs)} sources")
        (eole_dir / f"hyps.{tag}.txt").write_text("".join(h + "\n" for h in hyps), encoding="utf-8")
        decodes[tag] = {**timing, "score": sacre(hyps, refs), "model": str(model)}
        log(f"eole {tag}: sacreBLEU {decodes[tag]['score']['bleu']:.2f}, predict {timing['process_wall_s']:.1f} s "
            f"(its own loop {timing['loop_s']})")
    return decodes


def run_eole(args: argparse.Namespace, ours: dict[str, Any], refs: list[str], budget_s: float,
             ckpt: int) -> dict[str, Any]:
    """eole on our pieces and vocabulary, trained for ``budget_s`` (our train loop's seconds), its
    last checkpoints averaged, the averaged and the last model decoded and scored against ``refs``."""
    eole_dir = Path(args.work_dir) / "eole"
    data, batch_size, yaml_path = write_train_config(args, ours, eole_dir, len(refs), ckpt)
    et = train_or_reuse(args, yaml_path, eole_dir, budget_s, ckpt)
    avg_dir, last = average_last(args.eole_venv, eole_dir, et["checkpoints"], ours["cfg"].average.checkpoints)
    decodes = decode_test(args, data, eole_dir, {"averaged": avg_dir, "last": last[-1]}, refs)
    return {"data": data, "batch_size": batch_size, "yaml_path": yaml_path, "train": et, "decodes": decodes}
