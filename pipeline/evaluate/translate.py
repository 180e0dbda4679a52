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

CLI (no Ray): ``python -m pipeline.evaluate.translate --model-dir DIR --spm spm.model < input.en``.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import pandas as pd
import torch

from model import ModelConfig, Transformer, beam_search
from pipeline import storage
from pipeline.stage import StageContext, StageResult

log = logging.getLogger(__name__)

PROGRESS_INTERVAL_S = 10.0


@dataclass
class DecodeSettings:
    beam_size: int = 4  # §6.1
    alpha: float = 0.6  # §6.1, length penalty
    max_len_a: float = 1.0  # §6.1: max output length = a * input length + b = input + 50
    max_len_b: int = 50

    @classmethod
    def from_eval(cls, ev: Any) -> "DecodeSettings":
        return cls(ev.beam_size, ev.alpha, ev.max_len_a, ev.max_len_b)


# ----------------------------------------------------------------------------- pure core


def max_source_len(max_positions: int, max_len_a: float, max_len_b: int) -> int:
    """Longest source (pieces + eos) whose whole output budget a * S + b (plus the fed bos)
    still fits the model's ``max_positions``; longer sources are truncated to this."""
    if max_len_a <= 0:
        return max_positions
    return max(1, min(max_positions, int((max_positions - 1 - max_len_b) / max_len_a)))


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
    """Positions grouped into batches of similar length: sort by length, then fill each batch
    while (sentences * longest) <= batch_tokens padded source tokens (a longer sentence gets a
    batch of its own). Longest batches come first so the slowest work is not left for last."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        if current and (len(current) + 1) * lengths[i] > batch_tokens:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches[::-1]


def pad_batch(sources: Sequence[Sequence[int]], pad_id: int) -> torch.Tensor:
    """(B, S) long, right-padded with pad_id."""
    width = max(len(s) for s in sources)
    out = torch.full((len(sources), width), pad_id, dtype=torch.long)
    for r, s in enumerate(sources):
        out[r, : len(s)] = torch.as_tensor(np.asarray(s, dtype=np.int64))
    return out


def load_model(model_path: str, model_config: dict[str, Any], device: str = "cpu") -> Transformer:
    """The Transformer with a ``model.pt`` state dict, in eval mode on ``device``."""
    model = Transformer(ModelConfig.from_dict(model_config))
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

    def __init__(self, model_path: str, model_config: dict[str, Any], spm_path: str,
                 settings: dict[str, Any], device: str = "cpu", num_threads: int = 0,
                 backend: str = "torch", ct2_model: str = ""):
        import sentencepiece as spm

        if num_threads > 0 and device == "cpu":
            torch.set_num_threads(num_threads)
        if device == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("translate: a GPU was asked for but torch sees none")
        self.device = device
        self.settings = DecodeSettings(**settings)
        self.cfg = ModelConfig.from_dict(model_config)
        self.sp = spm.SentencePieceProcessor(model_file=str(storage.local_copy(spm_path)))
        self._specials = {self.cfg.pad_id, self.cfg.bos_id, self.cfg.eos_id}
        self.ct2 = None  # eval.backend = "ctranslate2": the export stage's model (ct2_backend.py)
        if backend == "ctranslate2":
            from pipeline.evaluate.ct2_backend import CT2Engine

            self.ct2 = CT2Engine(str(storage.local_copy(ct2_model)), self.sp, model_config, self.settings,
                                 device, num_threads)
        elif backend == "torch":
            self.model = load_model(model_path, model_config, device)
        else:
            raise ValueError(f"translate: unknown backend {backend!r} (torch | ctranslate2)")

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
    mcfg = ModelConfig.from_dict(avg["model_config"])
    settings = DecodeSettings.from_eval(ev)
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
    kwargs = {"model_path": avg["model"], "model_config": avg["model_config"],
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


def _find_model(model_dir: str) -> tuple[str, dict[str, Any]]:
    """``model.pt`` + config from an ``average`` output dir or a train checkpoint dir."""
    cfg_uri, meta_uri = storage.join(model_dir, "model_config.json"), storage.join(model_dir, "meta.json")
    if storage.exists(cfg_uri):
        model_config = storage.read_json(cfg_uri)
    elif storage.exists(meta_uri):
        model_config = storage.read_json(meta_uri)["model_config"]
    else:
        raise SystemExit(f"{model_dir}: neither model_config.json (average) nor meta.json (checkpoint)")
    return storage.join(model_dir, "model.pt"), model_config


def _latest_outputs(work_dir: str, stage: str) -> dict[str, Any]:
    """The ``outputs`` of the most recently finished ``<work_dir>/<stage>/<key>/`` (local work dirs)."""
    from pipeline.stage import MANIFEST

    manifests = sorted(Path(work_dir, stage).glob(f"*/{MANIFEST}"), key=lambda p: p.stat().st_mtime)
    if not manifests:
        raise SystemExit(f"{work_dir}: no finished '{stage}' stage")
    log.info("using %s", manifests[-1].parent)
    return storage.read_json(str(manifests[-1]))["outputs"]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Translate stdin (one English sentence per line) to German.")
    p.add_argument("--model-dir", help="an average output dir or a checkpoint dir")
    p.add_argument("--spm", help="SentencePiece model (vocab stage's spm.model)")
    p.add_argument("--work-dir", help="instead of --model-dir/--spm: the latest average and vocab outputs here")
    p.add_argument("--config", help="a pipeline config file: its run.work_dir is the --work-dir")
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--alpha", type=float, default=0.6)
    p.add_argument("--max-len-a", type=float, default=1.0)
    p.add_argument("--max-len-b", type=int, default=50)
    p.add_argument("--batch-tokens", type=int, default=4000)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.config and not args.work_dir:
        from pipeline.config import load_config

        args.work_dir = load_config(args.config).run.work_dir
    if args.model_dir:
        model_path, model_config = _find_model(args.model_dir)
    elif args.work_dir:
        avg = _latest_outputs(args.work_dir, "average")
        model_path, model_config = avg["model"], avg["model_config"]
    else:
        p.error("give --model-dir or --work-dir")
    if not args.spm and args.work_dir:
        args.spm = _latest_outputs(args.work_dir, "vocab")["model"]
    if not args.spm:
        p.error("give --spm or --work-dir")
    settings = DecodeSettings(args.beam, args.alpha, args.max_len_a, args.max_len_b)
    tr = Translator(model_path, model_config, args.spm, asdict(settings), args.device)
    max_len = max_source_len(tr.cfg.max_positions, args.max_len_a, args.max_len_b)
    lines = sys.stdin.read().splitlines()
    pieces = [tr.sp.encode(line) for line in lines]
    sources, truncated = prepare_sources(pieces, max_len, tr.cfg.eos_id)
    hyps = [""] * len(lines)
    keep = [i for i, s in enumerate(sources) if s is not None]
    for batch in plan_batches([len(sources[i]) for i in keep], args.batch_tokens):
        members = [keep[m] for m in batch]
        out, _ = tr.translate_safely([sources[i] for i in members])
        for i, h in zip(members, out):
            hyps[i] = h
    sys.stdout.write("".join(h + "\n" for h in hyps))
    log.info("translated %d lines (%d empty, %d truncated)", len(lines), len(lines) - len(keep), sum(truncated))


if __name__ == "__main__":
    main()
