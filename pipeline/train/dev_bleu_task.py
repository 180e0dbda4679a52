"""Ray Train's validation task for dev BLEU (``validate_checkpoint``): one registered checkpoint.

Run by Ray Train in a task of its own (``pipeline/train/dev_bleu_validation.py`` builds its config). It skips
a checkpoint that is no longer the newest registered one (a backlog drains to the newest), scores
the others (``pipeline.decoding.dev_bleu.score_checkpoint``), writes a record for each
(``pipeline.decoding.dev_bleu_records``) and logs the scores to the train stage's MLflow run at the
checkpoint's step (``dev/bleu_sacre``, ``dev/chrf``, ``dev/bleu_tok_cs`` or ``dev/bleu_tok``,
``dev/bleu_time_s``) through ``RunLogger.log_metrics``, which logs a step only above the last one
the run holds: after a resume the curve continues without duplicates. Tracking trouble (retried
three times) never fails a validation.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from pipeline.decoding.dev_bleu import DevBleuSettings, metrics_of, score_checkpoint
from pipeline.decoding.dev_bleu_records import newest_registered_step, step_of, write_record
from pipeline.ray_env import worker_logging

log = logging.getLogger(__name__)


def validate_checkpoint(checkpoint: Any, *, run_dir: str, dev_dir: str, spm: str, settings: dict[str, Any],
                        tgt_lang: str, device: str, threads: int, batch_tokens: int,
                        tracking_uri: str | None, run_id: str | None, preprocess: str = "none") -> dict[str, float]:
    """Ray Train's validation function: ``checkpoint`` (a registered ``ray.train.Checkpoint``) first,
    the ``fn_kwargs`` of ``dev_bleu.validation_config``; returns the metrics Ray merges into the checkpoint's."""
    worker_logging()
    name = Path(checkpoint.path).name
    step = step_of(name)
    newest = newest_registered_step(run_dir)
    # newest_step: the newest registered checkpoint when the task started (the loop still trains
    # while it equals `step`, unless `step` is the last).
    base = {"checkpoint": name, "step": step, "settings": settings, "started_unix": time.time(),
            "newest_step": newest}
    if newest > step:
        log.info("dev BLEU: skipping %s (step %d): checkpoint at step %d is newer", name, step, newest)
        write_record(run_dir, {**base, "status": "skipped"})
        return {}
    t0 = time.perf_counter()
    try:
        with checkpoint.as_directory() as local:
            result = score_checkpoint(local, dev_dir, spm, DevBleuSettings.from_dict(settings), tgt_lang, device,
                                      threads, batch_tokens, preprocess)
    except Exception as e:
        write_record(run_dir, {**base, "status": "failed", "error": f"{type(e).__name__}: {e}",
                               "seconds": time.perf_counter() - t0})
        log.exception("dev BLEU: %s failed (training goes on)", name)
        raise
    result["seconds"] = time.perf_counter() - t0
    write_record(run_dir, {**base, "status": "validated", **result})
    metrics = metrics_of(result)
    _log_to_run(tracking_uri, run_id, {**metrics, "dev/bleu_time_s": result["seconds"]}, step)
    log.info("dev BLEU: %s (step %d): sacreBLEU %.2f, chrF %.2f on %d sentences (%s) in %.1f s", name, step,
             result["bleu_sacre"], result["chrf"], result["num_sentences"], result["engine"], result["seconds"])
    return metrics


def _log_to_run(uri: str | None, run_id: str | None, metrics: dict[str, float], step: int) -> None:
    """Into the train stage's run at `step`; tracking trouble never fails a validation."""
    if not run_id:
        return
    from pipeline.tracking import RunLogger

    for attempt in range(3):
        try:
            RunLogger(uri, run_id, timeout_s=30.0).log_metrics(metrics, step=step)
            return
        except Exception as e:  # noqa: BLE001 - any store error (SQLite busy, a server away)
            if attempt == 2:
                log.warning("dev BLEU: could not log step %d to MLflow (%s)", step, e)
            time.sleep(1.0)
