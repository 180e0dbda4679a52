"""The Multi30k tiny recipe end to end on one device, without Ray: gpu_check's "multi30k tiny recipe"
section, from a bundle made beforehand on any machine that runs the DAG.

    # here (a CPU with the project installed): the data stages, then the bundle (~1 min, 5 MiB)
    make multi30k ARGS="--to encode"
    .venv/bin/python benchmarks/gpu_multi30k.py bundle --config configs/multi30k-tiny.toml --out .gpu/multi30k
    # on the GPU machine (torch, numpy, pyarrow, pandas, sentencepiece, sacrebleu: no Ray, MLflow, sacremoses)
    bash benchmarks/gpu_check.sh --multi30k .gpu/multi30k

The bundle holds the encode stage's three splits, the SentencePiece model and the resolved config
with the model's config (`bundle.json`). `run` is the DAG's train -> average -> translate -> score
for this recipe, in one process: the real loop (`Trainer` on a `LocalSession`, dev loss every
`metrics.val_loss_interval_steps`, checkpoints every `checkpoint.interval_steps`, the last
`average.checkpoints` kept), `model.average_checkpoints`, `model.beam_search` over the test split in
length-sorted batches of `decode.batch_tokens`, and the benchmark's BLEU4 (`pipeline.decoding.bleu.
benchmark_bleu`, the score stage's `test/bleu_tok_lc`). It times training and decoding apart.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from model import ModelConfig, Transformer, average_checkpoints, beam_search, max_source_len  # noqa: E402
from pipeline.config import Config, from_dict  # noqa: E402
from pipeline.train.loop import LocalSession, LoopSpec, Trainer  # noqa: E402

SPLITS = ("train", "dev", "test")


def make_bundle(config: str, overrides: list[str], out: Path) -> Path:
    """Copy the finished encode stage's splits and the vocab's model of `config` into `out`."""
    from pipeline.config import load_config
    from pipeline.models import finished_stages
    from pipeline import storage
    from pipeline.models import model_config_for

    cfg = load_config(config, overrides)
    found = finished_stages(cfg, ["encode"], "gpu_multi30k bundle")
    enc, vocab = found["encode"].outputs, found["vocab"].outputs
    if out.exists():
        shutil.rmtree(out)
    for split in SPLITS:
        shutil.copytree(storage.local_copy(enc["splits"][split]["dir"]), out / split)
    shutil.copy(storage.local_copy(vocab["model"]), out / "spm.model")
    mc = model_config_for(cfg, vocab)
    (out / "bundle.json").write_text(json.dumps({"config": cfg.to_dict(), "model_config": mc.to_dict(),
                                                 "made_from": config, "overrides": overrides}, indent=2) + "\n")
    return out


class _KeepingSession(LocalSession):
    """LocalSession that keeps only the newest `keep` checkpoints (as Ray Train's num_to_keep)."""

    def __init__(self, root: Path, device: str, keep: int):
        super().__init__(root, device)
        self.keep = keep

    def report(self, metrics, checkpoint_dir, dir_name, upload_async=False) -> None:
        super().report(metrics, checkpoint_dir, dir_name, upload_async)
        for old in self.checkpoints()[:-self.keep]:
            shutil.rmtree(old)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def train(bundle: Path, cfg: Config, mc: ModelConfig, device: str, work: Path) -> tuple[dict, list[Path]]:
    spec = LoopSpec(cfg=cfg.to_dict(), model_config=mc.to_dict(), train_dir=str(bundle / "train"),
                    dev_dir=str(bundle / "dev"))
    session = _KeepingSession(work / "ckpt", device, max(cfg.checkpoint.num_to_keep, cfg.average.checkpoints))
    t0 = time.perf_counter()
    trainer = Trainer(spec, session)
    summary = trainer.run()
    _sync(device)
    wall = time.perf_counter() - t0
    last_val = summary["history_val"][-1] if summary["history_val"] else [None, None, None]
    return ({"train_s": wall, "steps": summary["final_step"], "ms_per_step": 1e3 * wall / max(summary["final_step"], 1),
             "tgt_tokens_per_s": summary["tokens_seen"]["tgt"] / wall, "val_loss": last_val[1],
             "precision": summary["precision"], "batch_shapes": summary["batch_shapes"],
             "compiled_graphs": summary["compiled_graphs"]},
            session.checkpoints()[-cfg.average.checkpoints:])


def translate_test(model: Transformer, bundle: Path, cfg: Config, mc: ModelConfig, device: str
                   ) -> tuple[list[str], list[str], float]:
    """(hypotheses, references, seconds) of the test split, beam search as the translate stage."""
    import sentencepiece as spm

    from pipeline.decoding.batching import pad_batch, plan_batches, prepare_sources, read_split

    ev = cfg.decode
    df = read_split(str(bundle / "test"), ["idx", "src_ids", "tgt"])
    if cfg.score.max_sentences:  # as the translate stage: the first N (smoke runs)
        df = df.iloc[:cfg.score.max_sentences]
    sources, _ = prepare_sources(df["src_ids"], max_source_len(mc.max_positions, ev.max_len_a, ev.max_len_b),
                                 mc.eos_id)
    sp = spm.SentencePieceProcessor(model_file=str(bundle / "spm.model"))
    keep = [i for i, s in enumerate(sources) if s is not None]
    hyps = [""] * len(sources)
    specials = {mc.pad_id, mc.bos_id, mc.eos_id}
    _sync(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        for batch in plan_batches([len(sources[i]) for i in keep], ev.batch_tokens):
            members = [keep[m] for m in batch]
            src = pad_batch([sources[i] for i in members], mc.pad_id).to(device, non_blocking=True)
            out = beam_search(model, src, beam_size=ev.beam_size, alpha=ev.alpha, max_len_a=ev.max_len_a,
                              max_len_b=ev.max_len_b)
            for i, ids in zip(members, out):
                hyps[i] = " ".join(sp.decode([int(t) for t in ids if t not in specials]).split())
    _sync(device)
    return hyps, [str(t) for t in df["tgt"]], time.perf_counter() - t0


def run(bundle: Path, device: str, work: Path, overrides: dict[str, dict[str, Any]] | None = None) -> dict:
    """Train, average, translate and score the bundle's recipe on `device`; the figures."""
    from pipeline.decoding.bleu import benchmark_bleu

    meta = json.loads((bundle / "bundle.json").read_text())
    raw = meta["config"]
    for section, values in (overrides or {}).items():
        raw.setdefault(section, {}).update(values)
    cfg = from_dict(raw)
    mc = ModelConfig.from_dict({**meta["model_config"], **(overrides or {}).get("model", {})})
    figures, checkpoints = train(bundle, cfg, mc, device, work)
    t0 = time.perf_counter()
    state = average_checkpoints([torch.load(c / "model.pt", map_location="cpu", weights_only=True)
                                 for c in checkpoints])
    model = Transformer(mc)
    model.load_state_dict(state)
    model = model.to(device).eval()
    figures["average_s"] = time.perf_counter() - t0
    figures["averaged"] = [c.name for c in checkpoints]
    hyps, refs, decode_s = translate_test(model, bundle, cfg, mc, device)
    score = benchmark_bleu(hyps, refs)
    figures.update(decode_s=decode_s, sentences=len(refs), sentences_per_s=len(refs) / decode_s,
                   bleu4=score.score, bleu4_detail=score.detail, beam_size=cfg.decode.beam_size)
    return figures


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("bundle", help="copy a finished encode stage into a bundle folder")
    b.add_argument("--config", default="configs/multi30k-tiny.toml")
    b.add_argument("--out", default=".gpu/multi30k")
    b.add_argument("overrides", nargs="*", help="--section.key=value, as given to the workflow")
    r = sub.add_parser("run", help="the recipe end to end on one device")
    r.add_argument("bundle")
    r.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    r.add_argument("--work", default="", help="checkpoints go here ('' = a temporary folder)")
    args, rest = ap.parse_known_args(argv)
    if args.cmd == "bundle":
        print(make_bundle(args.config, [*args.overrides, *rest], Path(args.out)))
        return 0
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        print(json.dumps(run(Path(args.bundle), args.device, Path(args.work or tmp)), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
