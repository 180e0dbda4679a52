"""Dev BLEU per checkpoint: what one validation costs at base size on CPU, and what it costs the loop.

``--validation``: one checkpoint of Transformer base (d_model 512, 6+6 layers, 8 heads, d_ff 2048,
a 37000-piece vocabulary; random weights, which is fine for timing) validated as the Ray task does
it (``pipeline.decoding.dev_bleu.score_checkpoint``: conversion to CTranslate2 int8 with the export
code, greedy or beam decoding of newstest2013's 3000 sentences, sacreBLEU + chrF + tokenized BLEU),
at each thread count of ``--threads``. A random model never predicts eos, so every hypothesis runs
to its length limit: the configured one (source + 50, the worst case) and one near real output
lengths (1.1 x source + 5) are both timed. The SentencePiece model is trained here on the
news-commentary sample; pieces it cannot learn from that little text are filled with placeholder
symbols, so its size is exactly 37000.

``--stall``: the local mode's train stage (configs/local.toml sizes, on the offline mirror) run twice
on one work dir, dev BLEU off and on (``--force train``), each reporting the loop's checkpoint stall
(``train/checkpoint_stall_s``: torch.save + ``ray.train.report``), its mean step time and wall time,
read back from MLflow.

    .venv/bin/python benchmarks/dev_bleu_bench.py --validation [--threads 1,2] [--beam 1]
    .venv/bin/python benchmarks/dev_bleu_bench.py --stall --work-dir /tmp/devbleu-bench [--max-steps 300] \
        [--also "--dev_bleu.sentences=300 --dev_bleu.beam_size=0 --dev_bleu.engine=ctranslate2"]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

VOCAB = 37000
DATA = Path(os.environ.get("WMT14_DATA", REPO.parent / "shared/data/wmt14"))


def base_spm(root: Path) -> Path:
    """A 37000-piece BPE model: what the sample supports, topped up with placeholder symbols."""
    import sentencepiece as spm

    text = []
    for name in ("train-sample/news-commentary-v11.train.en", "train-sample/news-commentary-v11.train.de"):
        text += (DATA / name).read_text(encoding="utf-8").splitlines()
    common = dict(sentence_iterator=None, model_type="bpe", character_coverage=1.0, pad_id=0, unk_id=1,
                  bos_id=2, eos_id=3, num_threads=2, minloglevel=2)
    probe = root / "probe"
    spm.SentencePieceTrainer.train(**{**common, "sentence_iterator": iter(text)}, model_prefix=str(probe),
                                   vocab_size=VOCAB, hard_vocab_limit=False)
    learned = spm.SentencePieceProcessor(model_file=f"{probe}.model").get_piece_size()
    fill = [f"<placeholder{i}>" for i in range(max(0, VOCAB - learned))]
    spm.SentencePieceTrainer.train(**{**common, "sentence_iterator": iter(text)}, model_prefix=str(root / "spm"),
                                   vocab_size=VOCAB, user_defined_symbols=fill)
    print(f"spm: {learned} learned pieces + {len(fill)} placeholders = {VOCAB}", flush=True)
    return root / "spm.model"


def base_checkpoint(root: Path) -> dict:
    import torch

    from model import ModelConfig, Transformer

    mc = ModelConfig(vocab_size=VOCAB, d_model=512, d_ff=2048, n_heads=8, n_encoder_layers=6, n_decoder_layers=6)
    torch.manual_seed(0)
    folder = root / "checkpoint_0001000"
    folder.mkdir()
    torch.save(Transformer(mc).state_dict(), folder / "model.pt")
    (folder / "meta.json").write_text(json.dumps({"step": 1000, "model_config": mc.to_dict()}))
    return {"folder": str(folder), "model_config": mc.to_dict()}


def dev_split(root: Path, spm_path: Path, num: int) -> tuple[str, float]:
    """newstest2013 as an encode-stage dev split (idx, src_ids, tgt); mean source pieces."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(spm_path))
    src = (DATA / "newstest2013.en").read_text(encoding="utf-8").splitlines()[:num]
    tgt = (DATA / "newstest2013.de").read_text(encoding="utf-8").splitlines()[:num]
    ids = sp.encode(src)
    out = root / "dev"
    out.mkdir()
    pq.write_table(pa.table({"idx": list(range(len(src))), "src_ids": ids, "tgt": tgt, "src": src}),
                   out / "part-0.parquet")
    return str(out), statistics.mean(len(i) for i in ids)


def bench_validation(args: argparse.Namespace) -> dict:
    import torch

    from pipeline.config import DecodeSettings
    from pipeline.decoding.conversion import export_ct2, export_hf
    from pipeline.decoding.dev_bleu import DevBleuSettings, score_checkpoint
    from pipeline.cpu_threads import use_threads

    use_threads(max(int(t) for t in args.threads.split(",")))
    rows = []
    with tempfile.TemporaryDirectory(prefix="devbleu-bench-") as tmp:
        root = Path(tmp)
        spm_path = base_spm(root)
        ckpt = base_checkpoint(root)
        dev_dir, mean_src = dev_split(root, spm_path, args.num_sentences)
        print(f"dev: {args.num_sentences} sentences, {mean_src:.1f} source pieces on average", flush=True)
        from model import ModelConfig

        t0 = time.perf_counter()
        state = torch.load(Path(ckpt["folder"]) / "model.pt", weights_only=True)
        export_hf(state, ModelConfig.from_dict(ckpt["model_config"]), str(spm_path), root / "hf")
        export_ct2(root / "hf", root / "ct2", "int8")
        convert_s = time.perf_counter() - t0
        print(f"conversion to CTranslate2 int8 alone: {convert_s:.1f} s", flush=True)
        for a, b, label in ((1.0, 50, "source + 50 (configured; worst case)"), (1.1, 5, "1.1 x source + 5")):
            for threads in (int(t) for t in args.threads.split(",")):
                settings = DevBleuSettings(0, "ctranslate2", "int8", DecodeSettings(args.beam, 0.6, a, b))
                t0 = time.perf_counter()
                r = score_checkpoint(ckpt["folder"], dev_dir, str(spm_path), settings, "de", "cpu", threads)
                wall = time.perf_counter() - t0
                row = {"length_limit": label, "threads": threads, "beam": args.beam, "validation_s": round(wall, 1),
                       "conversion_s": round(convert_s, 1), "sentences_per_s": round(r["num_sentences"] / wall, 1),
                       "num_sentences": r["num_sentences"], "engine": r["engine"]}
                rows.append(row)
                print(json.dumps(row), flush=True)
    return {"validation": rows, "mean_source_pieces": mean_src}


def _train_run(work: Path, mirror: str, dev_bleu: bool, max_steps: int, force: bool,
               overrides: list[str] | None = None) -> dict:
    from mlflow import MlflowClient

    from workflows import reproduce_base

    args = ["--config", "configs/local.toml", f"--run.work_dir={work}", f"--data.mirror={mirror}",
            f"--train.max_steps={max_steps}", f"--dev_bleu.enabled={str(dev_bleu).lower()}", *(overrides or []),
            "--to", "train"]
    t0 = time.perf_counter()
    assert reproduce_base.main([*args, *(["--force", "train"] if force else [])]) == 0
    stage_s = time.perf_counter() - t0
    client = MlflowClient(f"sqlite:///{work}/mlflow.db")
    exp = client.get_experiment_by_name("transformer-wmt14-ende")
    run = client.search_runs([exp.experiment_id], "tags.stage = 'train' and tags.cached = 'false'",
                             order_by=["attributes.start_time DESC"])[0]
    hist = lambda k: [m.value for m in sorted(client.get_metric_history(run.info.run_id, k), key=lambda m: m.step)]
    stalls, steps = hist("train/checkpoint_stall_s"), hist("train/step_time_s")
    return {"dev_bleu": dev_bleu, "overrides": " ".join(overrides or []), "checkpoints": len(stalls), "stall_median_s": round(statistics.median(stalls), 3),
            "stall_max_s": round(max(stalls), 3), "step_time_mean_s": round(statistics.mean(steps), 4),
            "train_loop_s": round(run.data.metrics.get("train/wall_s", 0.0), 1),
            "train_stage_s": round(stage_s, 1), "dev_points": len(hist("dev/bleu_sacre")),
            "dev_bleu_last": (hist("dev/bleu_sacre") or [None])[-1],
            "skipped": run.data.metrics.get("dev/bleu_num_skipped"),
            "validation_s": [round(v, 1) for v in hist("dev/bleu_time_s")]}


def bench_stall(args: argparse.Namespace) -> dict:
    os.chdir(REPO)
    mirror = os.environ.get("WMT14_MIRROR", str(REPO.parent / "shared/data/statmt-mirror"))
    work = Path(args.work_dir)
    # --force train on every run (train's key does not read dev BLEU settings: a cached train
    # output would be read back as this run's); the data stages run once, on the first.
    rows = [_train_run(work, mirror, False, args.max_steps, force=(work / "train").is_dir()),
            _train_run(work, mirror, True, args.max_steps, force=True)]
    if args.also:  # another dev BLEU setting beside local.toml's, e.g. an older one
        rows.append(_train_run(work, mirror, True, args.max_steps, force=True, overrides=args.also.split()))
    off = rows[0]["train_loop_s"]
    for r in rows:
        r["loop_vs_off"] = round(r["train_loop_s"] / off, 3) if off else None
    for r in rows:
        print(json.dumps(r), flush=True)
    return {"stall": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--validation", action="store_true")
    p.add_argument("--stall", action="store_true")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--beam", type=int, default=1)
    p.add_argument("--num-sentences", type=int, default=3000)
    p.add_argument("--work-dir", default="/tmp/devbleu-bench")
    p.add_argument("--max-steps", type=int, default=300)
    p.add_argument("--also", default="", help="--stall: a third run with these overrides (space-separated)")
    p.add_argument("--out", default="")
    args = p.parse_args()
    if not (args.validation or args.stall):
        p.error("nothing to measure: give --validation, --stall or both")
    out = {}
    if args.validation:
        out.update(bench_validation(args))
    if args.stall:
        out.update(bench_stall(args))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
