"""eole's side, set up: its own venv, our data and vocabulary as eole's files, its training config."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from peer import REPO, log

EOLE_VERSION = "0.6.4"
TORCH_VERSION = "2.13.0"


def venv_versions(venv: Path) -> dict[str, str] | None:
    """The eole and torch versions installed in ``venv``; None if it has no working python."""
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


def read_pairs(split_dir: str):
    """A split of our prepare stage (idx, src, tgt), in idx order."""
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


def eole_train_config(args: argparse.Namespace, cfg: Any, data: dict[str, Any], eole_dir: Path, ckpt: int,
                      batch_size: int) -> dict[str, Any]:
    """eole's train config: our model and recipe in eole's keys, no time limit (stopped by the budget)."""
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


def write_train_config(args: argparse.Namespace, ours: dict[str, Any], eole_dir: Path, n_test: int,
                       ckpt: int) -> tuple[dict[str, Any], int, Path]:
    """eole's data files and train.yaml; returns (the data, eole's batch_size, the config's path).

    eole's batch_size is in its padded max(src, tgt) tokens: set from the data (unless
    --eole-batch-size) to give our train.tokens_per_step target tokens per step."""
    cfg = ours["cfg"]
    data = write_eole_data(ours, eole_dir, n_test)
    st = data["stats"]["train"]
    batch_size = args.eole_batch_size or round(cfg.train.tokens_per_step * st["eole_batch_tokens"]
                                               / st["eole_loss_tokens"])
    ecfg = eole_train_config(args, cfg, data, eole_dir, ckpt, batch_size)
    yaml_path = eole_dir / "train.yaml"
    yaml_path.write_text(json.dumps(ecfg, indent=1))  # JSON is YAML
    log(f"eole: batch_size {batch_size} (padded max(src, tgt) tokens) for ~{cfg.train.tokens_per_step} target "
        f"tokens per step; config {yaml_path}")
    return data, batch_size, yaml_path
