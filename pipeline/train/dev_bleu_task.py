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

import contextlib
import logging
import os
import time
from pathlib import Path
from typing import Any

from pipeline.decoding.dev_bleu import DevBleuSettings, metrics_of, score_checkpoint
from pipeline.decoding.dev_bleu_records import newest_registered_step, step_of, write_record
from pipeline.ray_env import worker_logging

log = logging.getLogger(__name__)


def validate_checkpoint(checkpoint: Any, *, run_dir: str, dev_dir: str, spm: str, settings: dict[str, Any],
                        tgt_lang: str, device: str, threads: int, batch_tokens: int,
                        tracking_uri: str | None, run_id: str | None, preprocess: str = "none",
                        yield_cpu: bool = False) -> dict[str, float]:
    """Ray Train's validation function: ``checkpoint`` (a registered ``ray.train.Checkpoint``) first,
    the ``fn_kwargs`` of ``dev_bleu.validation_config``; returns the metrics Ray merges into the checkpoint's.
    `yield_cpu`: the task holds no CPU of its own (it shares the training's cores): it decodes
    only in the CPU time the training leaves (`yielding_cpu`)."""
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
        with yielding_cpu(yield_cpu), checkpoint.as_directory() as local:
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


@contextlib.contextmanager
def yielding_cpu(on: bool):
    """Within it (when `on`), this process runs at Linux's SCHED_IDLE (elsewhere at nice 19): it
    gets a core only when no other process wants it. A validation that shares a laptop's cores
    with the training otherwise preempts one of the step's two OpenMP threads now and then, and
    every parallel region then waits for that thread: the step slowed by more than the CPU time
    the validation took (docs/benchmarks.md). The policy before is restored after, where the
    kernel allows it (an unprivileged process may not always leave SCHED_IDLE)."""
    if not on:
        yield
        return
    idle = hasattr(os, "sched_setscheduler") and hasattr(os, "SCHED_IDLE")
    before = os.sched_getscheduler(0) if idle else os.getpriority(os.PRIO_PROCESS, 0)
    try:
        if idle:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        else:
            os.setpriority(os.PRIO_PROCESS, 0, 19)
    except OSError as e:
        log.info("dev BLEU: could not lower this task's CPU priority (%s)", e)
    try:
        yield
    finally:
        try:
            if idle:
                os.sched_setscheduler(0, before, os.sched_param(0))
            else:
                os.setpriority(os.PRIO_PROCESS, 0, before)
        except OSError as e:
            log.info("dev BLEU: this worker process stays at its lowered CPU priority (%s)", e)


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
