"""``translate``: beam search over the encoded test (and dev) set with Ray Data (§6.1).

beam 4, length penalty alpha 0.6, max output length = source length + 50 (``cfg.decode``), on
the averaged model from ``average``. Hypotheses are SentencePiece-decoded (detokenized) and
written one line per source sentence, in the split's ``idx`` order, to ``hyps.<split>.txt``.

The pure core is the shared library's: ``plan_batches`` (length-sorted, token-bounded batches),
``prepare_sources`` (empty / too-long sources) and ``Translator`` (a callable class that loads the
model once and translates a pandas batch). This stage is the thin Ray wrapper: ``run`` reads the
split on the driver (a test set is a few thousand rows), hands the planned batches to
``map_batches(Translator, concurrency=decode.num_workers)`` and streams the results back with a
progress log.

Bad input never stops the run or shifts a line: an empty source gives an empty line
(``num_empty``); a source that would not fit the model's positions together with its output
budget is truncated to ``max_source_len`` pieces (``num_truncated``).

``decode.backend = "ctranslate2"`` runs the ``export`` stage's CTranslate2 model in the same actors
instead of our beam search (``pipeline/decoding/ct2_backend.py``; the same batches, order and
bad-input handling).

``Translator`` and the batching are the shared library's (``pipeline.decoding.translator``,
``pipeline.decoding.batching``); so is the CLI (``python -m pipeline.decoding.translate_cli``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict
from typing import Any, Sequence

import pandas as pd

from model import max_source_len
from pipeline import storage
from pipeline.config import DecodeSettings
from pipeline.config.devices import use_gpus
from pipeline.decoding.batching import plan_split, read_split
from pipeline.decoding.translator import Translator, model_config_of
from pipeline.stage import StageContext, StageResult

log = logging.getLogger(__name__)

PROGRESS_INTERVAL_S = 10.0


# ----------------------------------------------------------------------------- Ray wrapper


def _ct2_model(ctx: StageContext) -> str:
    """The export stage's CTranslate2 model for decode.ct2_quantization, or why there is none."""
    export = ctx.inputs["export"].outputs
    if "not_exported" in export:
        raise ValueError(f"translate: decode.backend = 'ctranslate2' needs an exported model, but the export "
                         f"stage could not export this one ({export['not_exported']}); use decode.backend = 'torch'")
    return export[f"ct2_{ctx.cfg.decode.ct2_quantization}"]


def _actor_resources(cfg: Any) -> tuple[dict[str, Any], str, int]:
    """(map_batches resources, device, torch threads per actor)."""
    from pipeline.ray_env import cluster_gpus

    num_cpus = cfg.run.data_num_cpus
    if use_gpus(cfg.decode.use_gpu, cluster_gpus(), "decode.use_gpu"):
        return {"num_gpus": 1, "num_cpus": num_cpus}, "cuda", 0
    # Ray reserves run.data_num_cpus per actor (fewer than the node's CPUs, so Ray Data's read
    # tasks keep one: an actor pool holding every CPU deadlocks them), but the actors' torch
    # threads share out the whole node (decode.threads_per_worker, 0 = auto): decoding is the only
    # heavy work while translate runs, and one thread per actor would leave most of a laptop idle.
    threads = cfg.decode.threads_per_worker
    if threads <= 0:
        from pipeline.ray_env import node_cpus

        largest = max(node_cpus(), default=1)
        threads = int(largest // max(1, cfg.decode.num_workers))
    threads = max(1, int(num_cpus), threads)
    # Started with OMP_NUM_THREADS at that count (Ray would give them their CPU count), the actors
    # already have their threads and never call torch.set_num_threads (`pipeline.cpu_threads`).
    return {"num_cpus": num_cpus, "runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(threads)}}}, "cpu", threads


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
    dec, scored = ctx.cfg.decode, ctx.cfg.score
    avg, enc = ctx.inputs["average"].outputs, ctx.inputs["encode"].outputs
    mcfg = model_config_of(avg["model_config"])  # built once here; the actors get this object
    settings = DecodeSettings.of(dec)
    max_len = max_source_len(mcfg.max_positions, settings.max_len_a, settings.max_len_b)

    frames, rows, counts, next_batch = {}, [], {}, 0
    for split in scored.splits:
        frames[split] = read_split(enc["splits"][split]["dir"], ["idx", "src_ids"])
        if scored.max_sentences:  # smoke tests only: the report flags such a score as partial
            frames[split] = frames[split].iloc[:scored.max_sentences]
        planned, counts[split] = plan_split(split, frames[split], max_len, mcfg.eos_id, dec.batch_tokens, next_batch)
        next_batch += counts[split]["num_batches"]
        rows.append(planned)
        log.info("translate %s: %s (max source length %d)", split, counts[split], max_len)

    resources, device, threads = _actor_resources(ctx.cfg)
    kwargs = {"model_path": avg["model"], "model_config": mcfg,
              "spm_path": ctx.inputs["vocab"].outputs["model"], "settings": asdict(settings),
              "device": device, "num_threads": threads, "backend": dec.backend,
              "ct2_model": _ct2_model(ctx) if dec.backend == "ctranslate2" else ""}
    start = time.monotonic()
    results = translate_rows(pd.concat(rows, ignore_index=True), kwargs, dec.num_workers, resources)
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
    outputs.update({"decode": {**asdict(settings), "max_source_len": max_len, "batch_tokens": dec.batch_tokens,
                               "backend": dec.backend,
                               "num_workers": dec.num_workers, "device": device},
                    "wall_s": wall_s})
    return StageResult(outputs=outputs, metrics=metrics)


def _log_artifact(ctx: StageContext, uri: str) -> None:
    try:
        ctx.tracker.log_artifact(str(storage.local_copy(uri)), "hyps")
    except Exception:  # noqa: BLE001 - tracking must not fail a finished decode
        log.warning("could not log %s to the tracker", uri, exc_info=True)


if __name__ == "__main__":  # the CLI is the shared library's: say where rather than exit silently
    raise SystemExit("the translate CLI is `python -m pipeline.decoding.translate_cli` "
                     "(pipeline/decoding/translate_cli.py)")
