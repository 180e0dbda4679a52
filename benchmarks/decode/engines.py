"""``decode_bench.py --engines``: our beam search vs CTranslate2 float32 and int8 on one set of
weights and sentences, each in this process on one thread: sentences/s and sacreBLEU side by side.

In-process only (no Ray): its code may live outside the script, which Ray workers could not import.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from pipeline.config import DecodeSettings
from pipeline.cpu_threads import use_threads
from pipeline.decoding import translator

log = logging.getLogger("decode_bench")


ENGINES = (("ours (torch beam search, GNMT lp)", "torch", ""),
           ("ours, finished sentences kept to the batch's end", "torch-carry", ""),
           ("ctranslate2 float32", "ctranslate2", "ct2_float32"), ("ctranslate2 int8", "ctranslate2", "ct2_int8"))


def engine_assets(args: argparse.Namespace, root: Path) -> dict:
    """Weights for ``--engines``: the model of a pipeline config (``--config``, its DAG plan's
    average + vocab; ``--work-dir`` replaces its run.work_dir; ``pipeline.models.find_model``),
    else the tiny model of tests/support/tiny_model.py trained here (~30 s); exported here."""
    from pipeline.models import find_model
    from pipeline.decoding.conversion import export_all

    if args.config:
        files = find_model(config=args.config, work_dir=args.work_dir)
        assets = {"model": files.model, "model_config": files.model_config, "spm": files.spm}
    else:
        from tests.support.tiny_model import news_pairs, train_tiny_model

        assets = train_tiny_model(news_pairs(Path(args.data)), root / "tiny")
    assets.update(export_all(assets["model"], assets["model_config"], assets["spm"], root / "export"))
    return assets


def compare_engines(args: argparse.Namespace) -> dict:
    """Our beam search, CTranslate2 float32 and int8 on the same weights and planned batches, in
    this process, one thread each: sentences/s and sacreBLEU against the newstest2014 references."""
    import sacrebleu

    from model import DecoderState

    data = Path(args.data)
    src_file, ref_file = Path(args.src_file or data / "newstest2014.en"), Path(args.ref_file or data / "newstest2014.de")
    src = src_file.read_text(encoding="utf-8").splitlines()[:args.num_sentences]
    refs = ref_file.read_text(encoding="utf-8").splitlines()[:args.num_sentences]
    settings = asdict(DecodeSettings(beam_size=args.beam, alpha=args.alpha))  # §6.1: beam 4, alpha 0.6
    results: dict = {"settings": settings, "num_sentences": len(src), "threads": args.threads, "engines": []}
    use_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        assets = engine_assets(args, Path(tmp))
        results["model"] = assets["model_config"]
        first = None
        for name, backend, folder in ENGINES:
            carry = backend == "torch-carry"  # finished sentences stay in the batch to its end
            tr = translator.Translator(assets["model"], assets["model_config"], assets["spm"], settings,
                                      num_threads=args.threads, backend="torch" if carry else backend,
                                      ct2_model=assets.get(folder, ""))
            DecoderState.drops_sentences = not carry
            try:
                start = time.perf_counter()
                hyps, _ = translator.translate_lines(tr, src, args.batch_tokens)
                wall = time.perf_counter() - start
            finally:
                DecoderState.drops_sentences = True
            first = hyps if first is None else first
            bleu = sacrebleu.corpus_bleu(hyps, [refs], tokenize=args.tokenize).score
            results["engines"].append({"engine": name, "wall_s": wall, "sentences_per_s": len(src) / wall,
                                       "bleu_sacre": bleu, "same_as_ours": hyps == first})
            log.info("%-34s %7.1f sentences/s  BLEU %5.2f", name, len(src) / wall, bleu)
    base = results["engines"][0]["sentences_per_s"]
    for e in results["engines"]:
        e["speed_vs_ours"] = e["sentences_per_s"] / base
    return results
