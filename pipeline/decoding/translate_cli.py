"""The translate CLI (no Ray): ``python -m pipeline.decoding.translate_cli --config configs/local.toml < input.en``
(or ``--model models:/...``, or ``--model-dir DIR --spm spm.model``: ``pipeline.models.find_model``).
Reads English sentences from stdin, one per line, and writes one translation per line to stdout.
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import asdict

import torch

from pipeline.config import DecodeSettings
from pipeline.decoding.translator import Translator, translate_lines

log = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> None:
    d = DecodeSettings()
    p = argparse.ArgumentParser(description="Translate stdin (one English sentence per line) to German.",
                                epilog="Name the model with --config (its DAG plan's average + vocab outputs), "
                                       "--model models:/..., or --model-dir + --spm (pipeline/models.py).")
    p.add_argument("--config", action="append", default=[], help="the pipeline config file(s) the run used; "
                   "its --section.key=value overrides may follow")
    p.add_argument("--work-dir", default="", help="with --config: instead of its run.work_dir (local or s3://)")
    p.add_argument("--model", default="", help="a registry version: models:/<name>/<version> or models:/<name>@<alias>")
    p.add_argument("--tracking-uri", default="", help="with --model: the registry's MLflow (default: MLFLOW_TRACKING_URI)")
    p.add_argument("--model-dir", default="", help="an average output dir or a checkpoint dir (with --spm)")
    p.add_argument("--spm", default="", help="SentencePiece model (vocab stage's spm.model)")
    p.add_argument("--beam", type=int, default=d.beam_size)
    p.add_argument("--alpha", type=float, default=d.alpha)
    p.add_argument("--max-len-a", type=float, default=d.max_len_a)
    p.add_argument("--max-len-b", type=int, default=d.max_len_b)
    p.add_argument("--batch-tokens", type=int, default=4000)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args, overrides = p.parse_known_args(argv)
    if [o for o in overrides if not (o.startswith("--") and "=" in o)] or (overrides and not args.config):
        p.error(f"unrecognized arguments: {' '.join(overrides)} (config overrides go with --config)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from pipeline.models import ModelNotFound, find_model

    try:
        files = find_model(config=args.config, overrides=overrides, work_dir=args.work_dir, model_uri=args.model,
                           tracking_uri=args.tracking_uri, model_dir=args.model_dir, spm=args.spm)
    except ModelNotFound as e:
        p.error(str(e))
    settings = DecodeSettings(args.beam, args.alpha, args.max_len_a, args.max_len_b)
    tr = Translator(files.model, files.model_config, files.spm, asdict(settings), args.device, text=files.text)
    lines = sys.stdin.read().splitlines()
    hyps, counts = translate_lines(tr, lines, args.batch_tokens)
    sys.stdout.write("".join(h + "\n" for h in hyps))
    log.info("translated %d lines (%d empty, %d truncated) with %s%s", len(lines), counts["num_empty"],
             counts["num_truncated"], files.origin,
             f"; input preprocessed as the training text was ({tr.text.preprocess}), output detokenized"
             if tr.text.preprocess != "none" else "")


if __name__ == "__main__":
    main()
