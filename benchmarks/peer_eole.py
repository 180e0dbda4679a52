"""Ours vs eole 0.6.4 (the maintained OpenNMT-py successor), side by side (issue 25, item 5).

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
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

EOLE_VERSION = "0.6.4"
TORCH_VERSION = "2.13.0"
DEFAULT_CONFIG = REPO / "configs" / "peer" / "multi30k-ende-256.toml"
DEFAULT_MIRROR = (REPO / ".." / "shared" / "data" / "multi30k").resolve()
# Seconds per step of our train stage at this size on the 2-core CPU (issue 25's hand test: 1100 steps
# in 23 min, bf16); --smoke's tiny model is much faster.
OUR_SEC_PER_STEP = 1.25
SMOKE_SEC_PER_STEP = 0.15
SMOKE = {  # a tiny model on a slice of the data: proves the plumbing, not the numbers
    "vocab.size": 1000, "model.d_model": 64, "model.d_ff": 128, "model.n_heads": 2,
    "model.n_encoder_layers": 1, "model.n_decoder_layers": 1, "train.tokens_per_step": 800,
    "speed.max_tokens_per_batch": 1024, "train.warmup_steps": 100, "metrics.val_loss_interval_steps": 50,
    "metrics.log_interval_steps": 10, "data.max_pairs_per_corpus": 3000, "eval.max_sentences": 40,
}


def log(msg: str) -> None:
    print(f"[peer_eole {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ----------------------------------------------------------------------------- eole's venv


def venv_versions(venv: Path) -> dict[str, str] | None:
    py = venv / "bin" / "python"
    if not py.exists():
        return None
    code = ("import importlib.metadata as m, json\nout = {}\nfor p in ('eole', 'torch'):\n"
            "    try: out[p] = m.version(p)\n    except m.PackageNotFoundError: pass\nprint(json.dumps(out))")
    r = subprocess.run([str(py), "-c", code], capture_output=True, text=True)
    return json.loads(r.stdout) if r.returncode == 0 else None


def ensure_eole(venv: Path) -> dict[str, str]:
    """eole 0.6.4 in its own venv, on the CPU build of torch 2.13.0 (installed first)."""
    if venv.resolve() == (REPO / ".venv").resolve():
        raise SystemExit("--eole-venv must not be the project's .venv")
    have = venv_versions(venv) or {}
    if have.get("eole") == EOLE_VERSION and have.get("torch", "").startswith(TORCH_VERSION):
        log(f"eole {have['eole']} with torch {have['torch']} already in {venv}")
        return have
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install"]
    if not (venv / "bin" / "python").exists():
        log(f"creating {venv}")
        subprocess.run([shutil.which("python3") or sys.executable, "-m", "venv", str(venv)], check=True)
    log(f"installing torch=={TORCH_VERSION} first (pip takes the local CPU wheel), then eole=={EOLE_VERSION}")
    subprocess.run(pip + [f"torch=={TORCH_VERSION}"], check=True)
    torch_before = (venv_versions(venv) or {}).get("torch", "")
    # eole 0.6.4's CLI imports aiohttp (eole/bin/tools/load_test.py) without declaring it.
    subprocess.run(pip + [f"eole=={EOLE_VERSION}", "aiohttp"], check=True)
    have = venv_versions(venv) or {}
    if have.get("torch") != torch_before:
        raise SystemExit(f"pip replaced torch {torch_before} with {have.get('torch')} when installing eole")
    if have.get("eole") != EOLE_VERSION:
        raise SystemExit(f"{venv}: eole is {have.get('eole')}, not {EOLE_VERSION}")
    log(f"eole {have['eole']} with torch {have['torch']} in {venv}")
    return have


# ----------------------------------------------------------------------------- our side


def our_overrides(args: argparse.Namespace, steps: int, ckpt: int) -> list[str]:
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


OUR_ECHO = re.compile(r"stage \w+: (done|running|cached)|step \d+/\d+ \||translate: \d+ / \d+|sacreBLEU|Error|error:"
                      r"|Traceback")


def run_ours(args: argparse.Namespace, steps: int, ckpt: int) -> dict[str, Any]:
    from pipeline.config import load_config
    from pipeline.dag import compute_keys, read_manifest, stage_dir

    overrides = our_overrides(args, steps, ckpt)
    cmd = [sys.executable, "workflows/reproduce_base.py", "--config", str(args.config), "--to", "score", *overrides]
    log("ours: " + " ".join(cmd))
    t0 = time.monotonic()
    rc = run_logged(cmd, Path(args.work_dir) / "peer_eole.ours.log", REPO, OUR_ECHO)
    if rc != 0:
        raise SystemExit(f"our workflow failed (exit {rc}); see {Path(args.work_dir) / 'peer_eole.ours.log'}")
    cfg = load_config([args.config], overrides)
    keys = compute_keys(cfg)
    manifests = {}
    for stage in ("download", "prepare", "vocab", "train", "average", "translate", "score"):
        m = read_manifest(stage_dir(cfg, stage, keys[stage]), keys[stage])
        if m is None:
            raise SystemExit(f"ours: no manifest for stage {stage} (key {keys[stage]}) under {args.work_dir}")
        manifests[stage] = m
    log(f"ours: workflow done in {time.monotonic() - t0:.0f} s")
    return {"cfg": cfg, "manifests": manifests}


# ----------------------------------------------------------------------------- data for eole


def read_pairs(split_dir: str):
    import pandas as pd

    df = pd.read_parquet(split_dir, columns=["idx", "src", "tgt"])
    return df.sort_values("idx", kind="stable").reset_index(drop=True)


def write_eole_data(ours: dict[str, Any], eole_dir: Path, max_test: int) -> dict[str, Any]:
    """Our pairs as space-separated pieces of our spm.model, and eole's shared vocab file."""
    import sentencepiece as spm

    man = ours["manifests"]
    sp = spm.SentencePieceProcessor(model_file=man["vocab"].outputs["model"])
    data = eole_dir / "data"
    data.mkdir(parents=True, exist_ok=True)
    counts: Counter[str] = Counter()
    files, stats = {}, {}
    for split, name in (("train", "train"), ("dev", "valid"), ("test", "test")):
        df = read_pairs(man["prepare"].outputs["splits"][split]["dir"])
        if split == "test" and max_test:
            df = df.iloc[:max_test]
        src = sp.encode(df["src"].tolist(), out_type=str)
        tgt = sp.encode(df["tgt"].tolist(), out_type=str)
        for side, pieces in (("en", src), ("de", tgt)):
            path = data / f"{name}.{side}"
            path.write_text("".join(" ".join(p) + "\n" for p in pieces), encoding="utf-8")
            files[f"{name}.{side}"] = str(path)
            if split == "train":
                for p in pieces:
                    counts.update(p)
        stats[name] = {"pairs": len(df), "src_pieces": sum(map(len, src)), "tgt_pieces": sum(map(len, tgt))}
        if split == "train":
            # eole counts a sentence as max(src, tgt) tokens (tgt with <s> and </s>) in a token batch
            stats[name]["eole_batch_tokens"] = sum(max(len(s), len(t) + 2) for s, t in zip(src, tgt))
            stats[name]["eole_loss_tokens"] = sum(len(t) + 1 for t in tgt)  # target pieces + </s>
    # The same vocabulary: every piece of our spm.model but its control/unknown pieces (eole adds
    # its own <unk>, <blank>, <s>, </s> first), in id order, with the training counts.
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())
              if not (sp.is_control(i) or sp.is_unknown(i) or sp.is_unused(i))]
    vocab = data / "vocab.shared"
    vocab.write_text("".join(f"{p}\t{counts.get(p, 0)}\n" for p in pieces), encoding="utf-8")
    files["vocab"] = str(vocab)
    log(f"eole data: {stats}; vocab {len(pieces)} pieces + eole's 4 specials (ours: {sp.get_piece_size()})")
    return {"files": files, "stats": stats, "vocab_pieces": len(pieces), "spm_model": man["vocab"].outputs["model"]}


# ----------------------------------------------------------------------------- eole's side


def eole_train_config(args: argparse.Namespace, cfg: Any, data: dict[str, Any], eole_dir: Path, ckpt: int,
                      batch_size: int) -> dict[str, Any]:
    m, t = cfg.model, cfg.train
    f = data["files"]
    vocab_size = data["vocab_pieces"] + 4
    return {
        "save_data": str(eole_dir / "samples"), "overwrite": True, "seed": t.seed,
        "report_every": args.eole_report_every,
        "src_vocab": f["vocab"], "tgt_vocab": f["vocab"], "share_vocab": True,
        "src_vocab_size": vocab_size, "tgt_vocab_size": vocab_size, "vocab_size_multiple": 8,
        "src_words_min_frequency": 0, "tgt_words_min_frequency": 0, "n_sample": 0,
        "transforms": [],  # the text is already our pieces
        "data": {"corpus_1": {"path_src": f["train.en"], "path_tgt": f["train.de"]},
                 "valid": {"path_src": f["valid.en"], "path_tgt": f["valid.de"]}},
        "training": {
            "model_path": str(eole_dir / "model"), "keep_checkpoint": cfg.checkpoint.num_to_keep,
            "save_checkpoint_steps": ckpt, "train_steps": 10_000_000,  # stopped by the budget
            "valid_steps": cfg.metrics.val_loss_interval_steps, "valid_batch_size": 4096,
            "world_size": 1, "gpu_ranks": [],  # CPU
            "compute_dtype": args.eole_dtype,
            "batch_type": "tokens", "batch_size": batch_size, "batch_size_multiple": 1,
            "accum_count": [1], "accum_steps": [0], "normalization": "tokens",
            "bucket_size": 262144, "num_workers": args.eole_num_workers,
            "dropout": [m.dropout], "attention_dropout": [0.0], "dropout_steps": [0],  # ours: no attention dropout
            "optim": "adam", "adam_beta1": t.adam_beta1, "adam_beta2": t.adam_beta2, "adam_eps": t.adam_eps,
            "learning_rate": t.lr_scale, "decay_method": "noam", "warmup_steps": t.warmup_steps,
            "max_grad_norm": t.clip_norm, "label_smoothing": t.label_smoothing,
            "param_init_method": "xavier_uniform",
            "log_attention_entropy": False,  # logging only; off so that it costs eole nothing
        },
        "model": {
            "architecture": "transformer", "hidden_size": m.d_model, "layers": m.n_encoder_layers,
            "heads": m.n_heads, "transformer_ff": m.d_ff,
            "share_embeddings": True, "share_decoder_embeddings": True,  # ours ties all three
            "add_qkvbias": True, "add_final_linear_bias": True, "add_ffnbias": True,  # ours has these biases
            "embeddings": {"word_vec_size": m.d_model, "position_encoding_type": "SinusoidalInterleaved"},
        },
    }


STARTUP_TIMEOUT_S = 900  # eole's imports, vocab and model build: ~20 s on an idle 2-core CPU
STEP_RE = re.compile(r"Step\s+(\d+)/\s*\d+;.*?bsz:\s*([\d.]+)/\s*([\d.]+)/\s*[\d.]+;\s*([\d.]+)/\s*([\d.]+) tok/s;"
                     r"\s*([\d.]+) sec")


def train_eole(args: argparse.Namespace, venv: Path, yaml_path: Path, eole_dir: Path, budget_s: float,
               ckpt: int) -> dict[str, Any]:
    """Train until the training loop has run `budget_s` seconds, then stop eole."""
    model_dir = eole_dir / "model"
    if model_dir.exists():
        shutil.rmtree(model_dir)
    logfile = eole_dir / "train.log"
    cmd = [str(venv / "bin" / "eole"), "train", "-c", str(yaml_path)]
    log("eole: " + " ".join(cmd) + f" (stopped {budget_s:.0f} s after its training loop starts)")
    t_start = time.monotonic()
    state: dict[str, Any] = {"t_loop": None, "reports": []}

    def reader(stream: Any, f: Any) -> None:  # eole's log, parsed as it comes
        for line in stream:
            f.write(line)
            f.flush()
            if state["t_loop"] is None and "Start training loop" in line:
                state["t_loop"] = time.monotonic()
                log(f"eole: training loop started ({state['t_loop'] - t_start:.1f} s after launch)")
            mt = STEP_RE.search(line)
            if mt:
                state["reports"].append(tuple(float(x) for x in mt.groups()))
                if int(mt.group(1)) % (args.eole_report_every * 10) == 0:
                    print("    " + line.strip()[:220], flush=True)
            elif "Saving optimizer and weights" in line or "Validation" in line or "Error" in line:
                print("    " + line.strip()[:220], flush=True)

    stopped, t_stop = False, 0.0
    with logfile.open("w") as f:
        # its own process group (start_new_session): stopped together with its DataLoader workers
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        thread = threading.Thread(target=reader, args=(proc.stdout, f), daemon=True)
        thread.start()
        while proc.poll() is None:
            now = time.monotonic()
            if not stopped and state["t_loop"] is not None and now - state["t_loop"] >= budget_s:
                log(f"eole: budget of {budget_s:.0f} s spent: stopping it")
                _signal_group(proc.pid, signal.SIGTERM)
                stopped, t_stop = True, now
            elif stopped and now - t_stop > 15:
                _signal_group(proc.pid, signal.SIGKILL)
            elif not stopped and state["t_loop"] is None and now - t_start > STARTUP_TIMEOUT_S:
                log(f"eole: no training loop after {STARTUP_TIMEOUT_S} s: stopping it")
                _signal_group(proc.pid, signal.SIGKILL)
                stopped, t_stop = True, now
            time.sleep(0.1)
        thread.join(timeout=10)
    t_loop, reports = state["t_loop"], state["reports"]
    if not stopped:
        raise SystemExit(f"eole train exited by itself (code {proc.returncode}) before the budget; see {logfile}")
    if t_loop is None:
        raise SystemExit(f"eole never started its training loop; see {logfile}")
    if not reports:
        raise SystemExit(f"eole logged no training step; see {logfile}")
    ckpts = complete_checkpoints(model_dir)
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


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)  # the group of the one eole process this script started
    except ProcessLookupError:
        pass


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


# ----------------------------------------------------------------------------- scoring and report


def sacre(hyps: list[str], refs: list[str]) -> dict[str, Any]:
    import sacrebleu

    bleu = sacrebleu.metrics.BLEU()
    s = bleu.corpus_score(hyps, [refs])
    return {"bleu": s.score, "signature": str(bleu.get_signature()), "detail": str(s)}


def raw_refs(ours: dict[str, Any], n: int) -> list[str]:
    from pipeline.data.clean import file_lines

    lines = []
    for line in file_lines(ours["manifests"]["download"].outputs["test"]["tgt"]):
        if len(lines) == n:
            break
        lines.append(line.decode("utf-8").rstrip("\n"))
    if len(lines) != n:
        raise SystemExit(f"the raw test reference has {len(lines)} lines, expected {n}")
    return lines


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def table(rows: list[tuple[str, Any, Any, Any]]) -> str:
    def fmt(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:,.2f}" if abs(v) < 100 else f"{v:,.0f}"
        return str(v)

    out = ["| | ours | eole 0.6.4 | ours / eole |", "|---|---:|---:|---:|"]
    out += [f"| {name} | {fmt(a)} | {fmt(b)} | {fmt(r)} |" for name, a, b, r in rows]
    return "\n".join(out)


# ----------------------------------------------------------------------------- main


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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_all = time.monotonic()
    versions = ensure_eole(args.eole_venv)

    from pipeline.config import load_config

    base = load_config([args.config], our_overrides(args, 1, 1))
    args.beam_size, args.alpha = base.eval.beam_size, base.eval.alpha
    steps = args.our_steps or max(10, int(args.budget_s / args.our_sec_per_step))
    ckpt = args.ckpt_steps or max(5, 5 * round(steps / 20 / 5))
    steps = max(ckpt * base.eval.average_last, ckpt * round(steps / ckpt))  # the last step is a checkpoint
    log(f"budget {args.budget_s:.0f} s: ours trains {steps} steps (~{args.our_sec_per_step} s/step), "
        f"checkpoints every {ckpt} steps on both sides")

    # 1. ours
    ours = run_ours(args, steps, ckpt)
    man, cfg = ours["manifests"], ours["cfg"]
    tr = man["train"].outputs
    our_train_s = float(tr["wall_s"])
    our_tokens = float(tr["tokens_seen"]["tgt"])
    n_test = man["translate"].outputs["splits"]["test"]["num_sentences"]
    refs = raw_refs(ours, n_test)
    our_hyps = Path(man["translate"].outputs["splits"]["test"]["hyps"]).read_text(encoding="utf-8").splitlines()
    our_score = sacre(our_hyps, refs)
    log(f"ours: {tr['final_step']} steps in {our_train_s:.0f} s ({our_tokens / our_train_s:.0f} target tokens/s, "
        f"{tr.get('precision')}), sacreBLEU {our_score['bleu']:.2f}, translate {man['translate'].outputs['wall_s']:.1f} s")

    # 2. eole, on the same pieces and vocabulary, for our train loop's seconds
    eole_dir = Path(args.work_dir) / "eole"
    data = write_eole_data(ours, eole_dir, n_test)
    st = data["stats"]["train"]
    batch_size = args.eole_batch_size or round(cfg.train.tokens_per_step * st["eole_batch_tokens"]
                                               / st["eole_loss_tokens"])
    ecfg = eole_train_config(args, cfg, data, eole_dir, ckpt, batch_size)
    yaml_path = eole_dir / "train.yaml"
    yaml_path.write_text(json.dumps(ecfg, indent=1))  # JSON is YAML
    log(f"eole: batch_size {batch_size} (padded max(src, tgt) tokens) for ~{cfg.train.tokens_per_step} target "
        f"tokens per step; config {yaml_path}")
    result_file = eole_dir / "train_result.json"
    if args.skip_eole_train and result_file.exists():
        et = json.loads(result_file.read_text())
        log(f"eole: reusing {result_file}")
    else:
        et = train_eole(args, args.eole_venv, yaml_path, eole_dir, our_train_s, ckpt)
        result_file.write_text(json.dumps(et, indent=1))
    last = [Path(c) for c in et["checkpoints"]][-cfg.eval.average_last:]
    if len(last) < cfg.eval.average_last:
        log(f"WARNING: eole kept only {len(last)} complete checkpoints; averaging those")
    avg_dir = eole_dir / "averaged"
    if avg_dir.exists():
        shutil.rmtree(avg_dir)
    subprocess.run([str(args.eole_venv / "bin" / "python"), "-c", AVERAGE_CODE, str(avg_dir), *map(str, last)],
                   check=True)

    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=data["spm_model"])
    test_src = data["files"]["test.en"]
    decodes = {}
    for tag, model in (("averaged", avg_dir), ("last", last[-1])):
        pred = eole_dir / f"pred.{tag}.pieces"
        timing = predict_eole(args, args.eole_venv, model, test_src, pred, eole_dir, tag)
        hyps = [sp.decode(line.split()) for line in pred.read_text(encoding="utf-8").splitlines()]
        if len(hyps) != n_test:
            raise SystemExit(f"eole predict wrote {len(hyps)} lines for {n_test} sources")
        (eole_dir / f"hyps.{tag}.txt").write_text("".join(h + "\n" for h in hyps), encoding="utf-8")
        decodes[tag] = {**timing, "score": sacre(hyps, refs), "model": str(model)}
        log(f"eole {tag}: sacreBLEU {decodes[tag]['score']['bleu']:.2f}, predict {timing['process_wall_s']:.1f} s "
            f"(its own loop {timing['loop_s']})")

    # 3. the table
    tx = man["translate"].outputs
    our_tok_s = our_tokens / our_train_s
    e_avg = decodes["averaged"]
    rows = [
        ("training wall time, s (train loop)", our_train_s, et["loop_s"], ratio(our_train_s, et["loop_s"])),
        ("steps trained", int(tr["final_step"]), int(et["steps_logged"]), ratio(tr["final_step"], et["steps_logged"])),
        ("target tokens per step", our_tokens / tr["final_step"], et["tgt_tokens_per_step"],
         ratio(our_tokens / tr["final_step"], et["tgt_tokens_per_step"])),
        ("target tokens/s", our_tok_s, et["tgt_tokens_per_s"], ratio(our_tok_s, et["tgt_tokens_per_s"])),
        ("sacreBLEU, last-5 average (equal wall time)", our_score["bleu"], e_avg["score"]["bleu"],
         ratio(our_score["bleu"], e_avg["score"]["bleu"])),
        ("decode s, test_2016_flickr (beam 4, alpha 0.6)", tx["wall_s"], e_avg["process_wall_s"],
         ratio(tx["wall_s"], e_avg["process_wall_s"])),
    ]
    precision = tr.get("precision")
    notes = [
        f"Multi30k task 1 EN->DE (raw, cased), {st['pairs']} training pairs, test_2016_flickr {n_test} sentences; "
        f"sacreBLEU `{our_score['signature']}` against the raw German reference.",
        f"Model: d_model {cfg.model.d_model}, d_ff {cfg.model.d_ff}, {cfg.model.n_heads} heads, "
        f"{cfg.model.n_encoder_layers}+{cfg.model.n_decoder_layers} layers, shared {data['vocab_pieces'] + 4}-piece "
        f"vocabulary (our spm.model), dropout {cfg.model.dropout}, label smoothing {cfg.train.label_smoothing}, "
        f"Noam lr factor {cfg.train.lr_scale} / {cfg.train.warmup_steps} warmup, ~{cfg.train.tokens_per_step} target "
        f"tokens per step, last {cfg.eval.average_last} checkpoints (every {ckpt} steps) averaged.",
        f"Precision: ours speed.precision = {cfg.speed.precision!r} -> {precision}; eole compute_dtype {args.eole_dtype}.",
        "Norm placement: ours post-norm (the paper's); eole PRE-norm (eole 0.6.4 has no post-norm decoder layer).",
        f"Training time: ours = the train stage's loop time (manifest wall_s), budget {args.budget_s:.0f} s as "
        f"max_steps {steps}; eole = stopped {et['loop_s']:.0f} s after its 'Start training loop' line (start-up "
        f"excluded on both sides). eole's steps and target tokens are from its last log line (step "
        f"{et['steps_logged']} at {et['seconds_at_last_log']:.0f} s; tokens = sum of its mean target tokens per batch "
        f"x steps of each report window, over those seconds); its last checkpoint is step "
        f"{et['checkpoint_steps'][-1] if et['checkpoint_steps'] else None}.",
        f"eole batching: batch_size {batch_size} in its padded max(src, tgt) tokens (set from the data for "
        f"~{cfg.train.tokens_per_step} target tokens); DataLoader workers {args.eole_num_workers}; "
        "attention_dropout 0 (ours has none); log_attention_entropy off.",
        "Decode seconds: ours = the translate stage's decode (Ray Data actor start, model load and beam search; "
        f"backend {tx['decode']['backend']}); eole = the whole `eole predict` process (imports, model load, "
        f"decoding; its own loop time {e_avg['loop_s']} s), default batch (30 sentences) and length caps "
        "(max_length 250, ratio 2; ours: source + 50).",
        f"eole unaveraged (last checkpoint): sacreBLEU {decodes['last']['score']['bleu']:.2f}.",
        f"Our score stage's own sacreBLEU: {man['score'].outputs['scores']['test'].get('bleu_sacre')}.",
    ]
    if args.smoke:
        notes.insert(0, "SMOKE RUN: tiny model, sliced data: plumbing check only, the numbers mean nothing.")
    md = table(rows) + "\n\n" + "\n".join(f"- {n}" for n in notes)
    print("\n" + md + "\n", flush=True)
    result = {
        "rows": [{"metric": n, "ours": a, "eole": b, "ours_over_eole": r} for n, a, b, r in rows],
        "markdown": md, "notes": notes, "smoke": args.smoke, "budget_s": args.budget_s,
        "ours": {"train": {k: tr.get(k) for k in ("final_step", "wall_s", "tokens_seen", "precision", "data")},
                 "train_key": man["train"].key, "translate_wall_s": tx["wall_s"],
                 "translate_stage_wall_s": man["translate"].extra.get("wall_s"), "score": our_score,
                 "score_stage": man["score"].outputs["scores"].get("test"), "max_steps": steps,
                 "checkpoint_interval_steps": ckpt, "work_dir": args.work_dir},
        "eole": {"versions": versions, "train": et, "batch_size": batch_size, "decode": decodes,
                 "config": str(yaml_path), "data_stats": data["stats"]},
        "wall_s_total": time.monotonic() - t_all,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
