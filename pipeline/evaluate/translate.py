"""``translate``: beam search over the encoded test (and dev) set with Ray Data (§6.1).

beam 4, length penalty alpha 0.6, max output length = source length + 50 (``cfg.eval``), on
the averaged model from ``average``. Hypotheses are SentencePiece-decoded (detokenized) and
written one line per source sentence, in the split's ``idx`` order, to ``hyps.<split>.txt``.

Pure core: ``plan_batches`` (length-sorted, token-bounded batches), ``prepare_sources``
(empty / too-long sources) and ``Translator`` (a callable class that loads the model once and
translates a pandas batch). Thin Ray wrapper: ``run`` reads the split on the driver (a test set
is a few thousand rows), hands the planned batches to ``map_batches(Translator, concurrency=
eval.num_workers)`` and streams the results back with a progress log.

Bad input never stops the run or shifts a line: an empty source gives an empty line
(``num_empty``); a source that would not fit the model's positions together with its output
budget is truncated to ``max_source_len`` pieces (``num_truncated``).

``eval.backend = "ctranslate2"`` runs the ``export`` stage's CTranslate2 model in the same actors
instead of our beam search (``ct2_backend.py``; the same batches, order and bad-input handling).

CLI (no Ray): ``python -m pipeline.evaluate.translate --config configs/local.toml < input.en`` (or
``--model models:/...``, or ``--model-dir DIR --spm spm.model``: ``pipeline.models.find_model``).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
import typing
from dataclasses import asdict
from typing import Any, Iterable, Sequence

import numpy as np
import pandas as pd
import torch

from model import ModelConfig, Transformer, beam_search, max_source_len
from pipeline import storage
from pipeline.config import Backend, DecodeSettings
from pipeline.packing import pack_by_length
from pipeline.stage import StageContext, StageResult

log = logging.getLogger(__name__)

PROGRESS_INTERVAL_S = 10.0


# ----------------------------------------------------------------------------- pure core


def prepare_sources(pieces: Iterable[Sequence[int]], max_len: int, eos_id: int
                    ) -> tuple[list[list[int] | None], list[bool]]:
    """Model inputs ``pieces + [eos]`` cut to ``max_len`` tokens (eos kept); None for an empty
    source (no pieces), which is not translated. Returns (sources, truncated flags)."""
    sources: list[list[int] | None] = []
    truncated: list[bool] = []
    for p in pieces:
        p = [int(t) for t in p]
        if not p:
            sources.append(None)
            truncated.append(False)
            continue
        cut = len(p) + 1 > max_len
        sources.append((p[: max_len - 1] if cut else p) + [eos_id])
        truncated.append(cut)
    return sources, truncated


def plan_batches(lengths: Sequence[int], batch_tokens: int) -> list[list[int]]:
    """Positions in batches of similar length, at most ``batch_tokens`` padded source tokens each
    (``pack_by_length``); longest batches first, so the slowest work is not left for last."""
    return pack_by_length(lengths, batch_tokens)[::-1]


def pad_batch(sources: Sequence[Sequence[int]], pad_id: int) -> torch.Tensor:
    """(B, S) long, right-padded with pad_id."""
    width = max(len(s) for s in sources)
    out = torch.full((len(sources), width), pad_id, dtype=torch.long)
    for r, s in enumerate(sources):
        out[r, : len(s)] = torch.as_tensor(np.asarray(s, dtype=np.int64))
    return out


def model_config_of(model_config: ModelConfig | dict[str, Any]) -> ModelConfig:
    """A ``ModelConfig`` from a manifest's ``model_config`` dict (or the object itself)."""
    return model_config if isinstance(model_config, ModelConfig) else ModelConfig.from_dict(model_config)


def load_model(model_path: str, model_config: ModelConfig | dict[str, Any], device: str = "cpu") -> Transformer:
    """The Transformer with a ``model.pt`` state dict, in eval mode on ``device``."""
    model = Transformer(model_config_of(model_config))
    state = torch.load(storage.local_copy(model_path), weights_only=True, map_location="cpu")
    model.load_state_dict(state)
    return model.to(device).eval()


class Translator:
    """Loads the model and the SentencePiece model once; translates batches of token ids.

    A Ray Data actor class (``map_batches(Translator, ...)``) and the CLI's engine alike.
    ``__call__`` takes a pandas batch with ``batch_id`` and ``src_ids`` (plus any key columns,
    passed through) and returns it with ``hyp`` (detokenized text) and ``failed`` instead of
    ``src_ids``; each ``batch_id`` group is one beam-search call.
    """

    def __init__(self, model_path: str, model_config: ModelConfig | dict[str, Any], spm_path: str,
                 settings: dict[str, Any], device: str = "cpu", num_threads: int = 0,
                 backend: str = "torch", ct2_model: str = ""):
        import sentencepiece as spm

        if num_threads > 0 and device == "cpu":
            torch.set_num_threads(num_threads)
        if device == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("translate: a GPU was asked for but torch sees none")
        self.device = device
        self.settings = DecodeSettings.of(settings)
        self.cfg = model_config_of(model_config)
        self.sp = spm.SentencePieceProcessor(model_file=str(storage.local_copy(spm_path)))
        self._specials = {self.cfg.pad_id, self.cfg.bos_id, self.cfg.eos_id}
        self.ct2 = None  # eval.backend = "ctranslate2": the export stage's model (ct2_backend.py)
        if backend == "ctranslate2":
            from pipeline.evaluate.ct2_backend import CT2Engine

            self.ct2 = CT2Engine(str(storage.local_copy(ct2_model)), self.sp, self.cfg, self.settings,
                                 device, num_threads)
        elif backend == "torch":
            self.model = load_model(model_path, self.cfg, device)
        else:
            raise ValueError(f"translate: unknown backend {backend!r} ({' | '.join(typing.get_args(Backend))})")

    def translate_ids(self, sources: Sequence[Sequence[int]]) -> list[str]:
        """Model inputs (pieces + eos, no padding) -> detokenized hypotheses."""
        s = self.settings
        if self.ct2 is not None:
            return [self.detokenize(ids) for ids in self.ct2.translate_ids(sources)]
        src = pad_batch(sources, self.cfg.pad_id).to(self.device)
        out = beam_search(self.model, src, beam_size=s.beam_size, alpha=s.alpha,
                          max_len_a=s.max_len_a, max_len_b=s.max_len_b)
        return [self.detokenize(ids) for ids in out]

    def detokenize(self, ids: Sequence[int]) -> str:
        text = self.sp.decode([int(t) for t in ids if t not in self._specials])
        return " ".join(text.split())  # one line per sentence, whatever the pieces held

    def translate_safely(self, sources: list[list[int]]) -> tuple[list[str], list[bool]]:
        """A failing batch (e.g. out of memory) is retried one sentence at a time; a sentence
        that still fails gets an empty line and ``failed=True`` (the stage reports them)."""
        try:
            return self.translate_ids(sources), [False] * len(sources)
        except Exception:  # noqa: BLE001 - every failure is logged and counted, never hidden
            log.exception("translate: a batch of %d sentences failed; retrying one by one", len(sources))
        hyps, failed = [], []
        for s in sources:
            try:
                hyps.append(self.translate_ids([s])[0])
                failed.append(False)
            except Exception:  # noqa: BLE001
                log.exception("translate: a sentence of %d tokens failed", len(s))
                hyps.append("")
                failed.append(True)
        return hyps, failed

    def __call__(self, batch: pd.DataFrame) -> pd.DataFrame:
        parts = []
        for _, group in batch.groupby("batch_id", sort=False):
            sources = [[int(t) for t in ids] for ids in group["src_ids"]]
            hyps, failed = self.translate_safely(sources)
            parts.append(group.drop(columns=["src_ids"]).assign(hyp=hyps, failed=failed))
        return pd.concat(parts, ignore_index=True)


# ----------------------------------------------------------------------------- reading splits


def read_split(uri: str, columns: list[str]) -> pd.DataFrame:
    """An encoded split's Parquet shards as one DataFrame in ``idx`` order (idx must be unique)."""
    import pyarrow.dataset as pads

    fs, path = storage.resolve(uri)
    table = pads.dataset(path, filesystem=fs, format="parquet").to_table(columns=columns)
    df = table.to_pandas().sort_values("idx", kind="stable").reset_index(drop=True)
    if df["idx"].duplicated().any():
        raise ValueError(f"{uri}: duplicate idx values; the split's order cannot be restored")
    return df


def plan_split(split: str, df: pd.DataFrame, max_len: int, eos_id: int, batch_tokens: int,
               first_batch_id: int = 0) -> tuple[pd.DataFrame, dict[str, int]]:
    """Rows to translate (split, idx, batch_id, src_ids) and the split's counts."""
    sources, truncated = prepare_sources(df["src_ids"], max_len, eos_id)
    keep = [i for i, s in enumerate(sources) if s is not None]
    batches = plan_batches([len(sources[i]) for i in keep], batch_tokens)
    rows = []
    for b, members in enumerate(batches):
        for m in members:
            i = keep[m]
            rows.append((split, int(df["idx"].iat[i]), first_batch_id + b, sources[i]))
    counts = {"num_sentences": len(df), "num_empty": len(df) - len(keep),
              "num_truncated": int(sum(truncated)), "num_batches": len(batches)}
    return pd.DataFrame(rows, columns=["split", "idx", "batch_id", "src_ids"]), counts


# ----------------------------------------------------------------------------- Ray wrapper


def _ct2_model(ctx: StageContext) -> str:
    """The export stage's CTranslate2 model for eval.ct2_quantization, or why there is none."""
    export = ctx.inputs["export"].outputs
    if "not_exported" in export:
        raise ValueError(f"translate: eval.backend = 'ctranslate2' needs an exported model, but the export "
                         f"stage could not export this one ({export['not_exported']}); use eval.backend = 'torch'")
    return export[f"ct2_{ctx.cfg.eval.ct2_quantization}"]


def _actor_resources(cfg: Any) -> tuple[dict[str, Any], str, int]:
    """(map_batches resources, device, torch threads per actor)."""
    import ray

    num_cpus = cfg.run.data_num_cpus
    if cfg.eval.use_gpu and ray.cluster_resources().get("GPU", 0) >= 1:
        return {"num_gpus": 1, "num_cpus": num_cpus}, "cuda", 0
    # Ray reserves run.data_num_cpus per actor (fewer than the node's CPUs, so Ray Data's read
    # tasks keep one: an actor pool holding every CPU deadlocks them), but the actors' torch
    # threads share out the whole node (eval.threads_per_worker, 0 = auto): decoding is the only
    # heavy work while translate runs, and one thread per actor left most of a laptop idle.
    threads = cfg.eval.threads_per_worker
    if threads <= 0:
        from pipeline.ray_env import node_cpus

        largest = max(node_cpus(), default=1)
        threads = int(largest // max(1, cfg.eval.num_workers))
    return {"num_cpus": num_cpus}, "cpu", max(1, int(num_cpus), threads)


def translate_rows(rows: pd.DataFrame, translator_kwargs: dict[str, Any], num_workers: int,
                   resources: dict[str, Any], translator_cls: type = None) -> pd.DataFrame:
    """Decode planned rows on ``num_workers`` Ray Data actors; results in any order.
    (``translator_cls``: a ``Translator`` subclass, for benchmarks that instrument it.)"""
    import ray

    if rows.empty:  # every source empty: nothing to decode
        return rows.drop(columns=["src_ids"]).assign(hyp=pd.Series(dtype=str), failed=pd.Series(dtype=bool))
    blocks = [g.reset_index(drop=True) for _, g in rows.groupby("batch_id", sort=False)]
    # The input sits in the object store (from_pandas): no read tasks compete with the actors for
    # CPUs, so the read-task starvation of ray#44687 cannot happen here.
    # One planned batch per block and per call; one call in flight per actor, so the longest
    # batches (first) spread over the actors and none waits behind another actor's queue.
    pool = ray.data.ActorPoolStrategy(size=num_workers, max_tasks_in_flight_per_actor=1)
    ds = ray.data.from_pandas(blocks).map_batches(
        translator_cls or Translator, fn_constructor_kwargs=translator_kwargs, batch_size=None,
        batch_format="pandas", compute=pool, **resources)
    total, done, parts = len(rows), 0, []
    start = last = time.monotonic()
    for batch in ds.iter_batches(batch_size=None, batch_format="pandas"):
        parts.append(batch)
        done += len(batch)
        now = time.monotonic()
        if now - last >= PROGRESS_INTERVAL_S or done == total:
            last = now
            log.info("translate: %d / %d sentences, %.1f sentences/s", done, total, done / max(now - start, 1e-9))
    return pd.concat(parts, ignore_index=True)


def write_hyps(uri: str, idx: Sequence[int], results: pd.DataFrame) -> list[str]:
    """One line per source, in ``idx`` order; sources without a result (empty) get ''."""
    by_idx = dict(zip(results["idx"].astype(int), results["hyp"]))
    lines = [by_idx.get(int(i), "") for i in idx]
    storage.write_text(uri, "".join(line + "\n" for line in lines))
    return lines


def run(ctx: StageContext) -> StageResult:
    ev = ctx.cfg.eval
    avg, enc = ctx.inputs["average"].outputs, ctx.inputs["encode"].outputs
    mcfg = model_config_of(avg["model_config"])  # built once here; the actors get this object
    settings = DecodeSettings.of(ev)
    max_len = max_source_len(mcfg.max_positions, settings.max_len_a, settings.max_len_b)

    frames, rows, counts, next_batch = {}, [], {}, 0
    for split in ev.splits:
        frames[split] = read_split(enc["splits"][split]["dir"], ["idx", "src_ids"])
        if ev.max_sentences:  # smoke tests only: the report flags such a score as partial
            frames[split] = frames[split].iloc[:ev.max_sentences]
        planned, counts[split] = plan_split(split, frames[split], max_len, mcfg.eos_id, ev.batch_tokens, next_batch)
        next_batch += counts[split]["num_batches"]
        rows.append(planned)
        log.info("translate %s: %s (max source length %d)", split, counts[split], max_len)

    resources, device, threads = _actor_resources(ctx.cfg)
    kwargs = {"model_path": avg["model"], "model_config": mcfg,
              "spm_path": ctx.inputs["vocab"].outputs["model"], "settings": asdict(settings),
              "device": device, "num_threads": threads, "backend": ev.backend,
              "ct2_model": _ct2_model(ctx) if ev.backend == "ctranslate2" else ""}
    start = time.monotonic()
    results = translate_rows(pd.concat(rows, ignore_index=True), kwargs, ev.num_workers, resources)
    wall_s = time.monotonic() - start

    outputs: dict[str, Any] = {"splits": {}}
    metrics = {"translate/sentences_per_s": sum(c["num_sentences"] for c in counts.values()) / max(wall_s, 1e-9)}
    for split, df in frames.items():
        uri = storage.absolute(storage.join(ctx.out_dir, f"hyps.{split}.txt"))
        res = results[results["split"] == split]
        write_hyps(uri, df["idx"], res)
        _log_artifact(ctx, uri)
        c = counts[split]
        outputs["splits"][split] = {"hyps": uri, "num_sentences": c["num_sentences"], "num_empty": c["num_empty"],
                                    "num_truncated": c["num_truncated"], "num_failed": int(res["failed"].sum())}
        metrics.update({f"{split}/num_truncated": float(c["num_truncated"]),
                        f"{split}/num_empty": float(c["num_empty"])})
    num_failed = sum(s["num_failed"] for s in outputs["splits"].values())
    if num_failed:
        raise RuntimeError(f"translate: {num_failed} sentence(s) failed to decode (see the log); "
                           f"hypotheses written to {ctx.out_dir} for inspection")
    outputs.update({"decode": {**asdict(settings), "max_source_len": max_len, "batch_tokens": ev.batch_tokens,
                               "backend": ev.backend,
                               "num_workers": ev.num_workers, "device": device},
                    "wall_s": wall_s})
    return StageResult(outputs=outputs, metrics=metrics)


def _log_artifact(ctx: StageContext, uri: str) -> None:
    try:
        ctx.tracker.log_artifact(str(storage.local_copy(uri)), "hyps")
    except Exception:  # noqa: BLE001 - tracking must not fail a finished decode
        log.warning("could not log %s to the tracker", uri, exc_info=True)


# ----------------------------------------------------------------------------- CLI


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
    tr = Translator(files.model, files.model_config, files.spm, asdict(settings), args.device)
    lines = sys.stdin.read().splitlines()
    hyps, counts = translate_lines(tr, lines, args.batch_tokens)
    sys.stdout.write("".join(h + "\n" for h in hyps))
    log.info("translated %d lines (%d empty, %d truncated) with %s", len(lines), counts["num_empty"],
             counts["num_truncated"], files.origin)


def translate_lines(tr: Translator, lines: Sequence[str], batch_tokens: int) -> tuple[list[str], dict[str, int]]:
    """Plain-text lines -> hypotheses in the same order (the CLI's and the engine benchmark's loop)."""
    s = tr.settings
    sources, truncated = prepare_sources([tr.sp.encode(line) for line in lines],
                                         max_source_len(tr.cfg.max_positions, s.max_len_a, s.max_len_b), tr.cfg.eos_id)
    hyps = [""] * len(lines)
    keep = [i for i, src in enumerate(sources) if src is not None]
    for batch in plan_batches([len(sources[i]) for i in keep], batch_tokens):
        members = [keep[m] for m in batch]
        out, _ = tr.translate_safely([sources[i] for i in members])
        for i, h in zip(members, out):
            hyps[i] = h
    return hyps, {"num_empty": len(lines) - len(keep), "num_truncated": int(sum(truncated))}


if __name__ == "__main__":
    main()
