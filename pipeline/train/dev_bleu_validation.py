"""Dev BLEU per registered checkpoint, off the training devices: the Ray Train wiring of it.

The train stage gives its `TorchTrainer` a ``ValidationConfig(fn=validate_checkpoint, ...)``
(``validation_config``) and rank 0 reports each checkpoint with ``validation=True``. Ray Train
2.60 then, once the checkpoint is registered (its upload complete), runs ``validate_checkpoint``
(``pipeline/train/dev_bleu_task.py``) in a Ray task of its own (``dev_bleu.resources``: a CPU by default, a
GPU if given), at most one at a time (``MAX_IN_FLIGHT_VALIDATIONS = 1`` in its ValidationManager),
while the workers train on: ``ray.train.report`` does not wait for it. The returned metrics are
merged into the checkpoint's metrics in Ray's checkpoint-manager snapshot; a task that raises is
logged by Ray (``VALIDATION_FAILED``) and never fails the run; the run's end waits for the queued
ones. What one validation does: ``pipeline.decoding.dev_bleu.score_checkpoint``.

Backlog: Ray queues every reported checkpoint and starts the next validation when one ends. A
task whose checkpoint is no longer the newest registered one (Ray's snapshot names a later one)
skips it, so a backlog drains to the newest checkpoint; skips are recorded and counted. The
records (``pipeline.decoding.dev_bleu_records``) are summed up here when training ends
(``summarize``).
"""

from __future__ import annotations

import logging
from typing import Any

from pipeline import storage
from pipeline.config import Config, parse_resources
from pipeline.decoding.dev_bleu import DevBleuSettings
from pipeline.decoding.dev_bleu_records import read_records

log = logging.getLogger(__name__)


def task_resources(cfg: Config) -> tuple[dict[str, Any], str, int]:
    """(ray.remote options, device, decoding threads) of the validation task."""
    res = parse_resources(cfg.dev_bleu.resources, "dev_bleu.resources")
    cpus, gpus = res.pop("CPU", 1.0), res.pop("GPU", 0.0)
    options: dict[str, Any] = {"num_cpus": cpus, "num_gpus": gpus, "max_retries": 0}
    if res:
        options["resources"] = res
    return options, "cuda" if gpus > 0 else "cpu", max(1, int(cpus))


def shares_training_cores(cfg: Config) -> bool:
    """The validation decodes on the CPU without a CPU of its own (``CPU=0``): on the training's cores."""
    options, device, _ = task_resources(cfg)
    return device == "cpu" and options["num_cpus"] == 0


def reserved_cpus(cfg: Config) -> float:
    """CPUs the validation task reserves on a node (train's auto CPU share leaves them free)."""
    return task_resources(cfg)[0]["num_cpus"] if cfg.dev_bleu.enabled else 0.0


def unavailable(cfg: Config, dev_dir: str, vocab: dict[str, Any]) -> str | None:
    """Why this train run gets no dev BLEU (None: it does)."""
    if not cfg.dev_bleu.enabled:
        return "dev_bleu.enabled = false"
    if not dev_dir:
        return "the encode stage has no dev split"
    if not vocab.get("model"):
        return "the vocab stage names no SentencePiece model"
    return None


def validation_config(cfg: Config, *, dev_dir: str, vocab: dict[str, Any], run_dir: str,
                      tracking_uri: str | None, run_id: str | None) -> Any | None:
    """The `TorchTrainer`'s ``validation_config``, or None (logged why) when there is no dev BLEU."""
    why = unavailable(cfg, dev_dir, vocab)
    if why:
        log.info("train: no dev BLEU per checkpoint (%s)", why)
        return None
    from ray.train import ValidationConfig, ValidationTaskConfig

    from pipeline.train.dev_bleu_task import validate_checkpoint

    options, device, threads = task_resources(cfg)
    kwargs = {"run_dir": storage.absolute(run_dir), "dev_dir": storage.absolute(dev_dir),
              "spm": storage.absolute(vocab["model"]), "settings": DevBleuSettings.from_config(cfg).to_dict(),
              "tgt_lang": cfg.data.tgt_lang, "preprocess": cfg.data.preprocess, "device": device, "threads": threads,
              "batch_tokens": cfg.decode.batch_tokens, "tracking_uri": tracking_uri, "run_id": run_id,
              "yield_cpu": shares_training_cores(cfg)}
    log.info("train: dev BLEU per checkpoint in a Ray task (%s), %s", options, kwargs["settings"])
    return ValidationConfig(fn=validate_checkpoint, task_config=ValidationTaskConfig(fn_kwargs=kwargs),
                            ray_remote_kwargs=options)


def summarize(run_dir: str, cfg: Config, dev_dir: str, vocab: dict[str, Any]
              ) -> tuple[dict[str, Any], dict[str, float]]:
    """The train stage's ``dev_bleu`` output (what `average` needs to score a checkpoint the same
    way: the dev split and the SentencePiece model) and its count metrics."""
    why_not = unavailable(cfg, dev_dir, vocab)
    records = read_records(run_dir)
    counts = {s: sum(r.get("status") == s for r in records) for s in ("validated", "skipped", "failed")}
    out = {"enabled": why_not is None, "why_not": why_not, "run_dir": run_dir,
           "dev_dir": storage.absolute(dev_dir) if dev_dir else "",
           "spm": storage.absolute(vocab["model"]) if vocab.get("model") else "",
           "settings": DevBleuSettings.from_config(cfg).to_dict(), "records": records,
           **{f"num_{s}": n for s, n in counts.items()}}
    if records:
        log.info("train: dev BLEU on %d checkpoint(s), %d skipped (backlog), %d failed", counts["validated"],
                 counts["skipped"], counts["failed"])
    return out, {f"dev/bleu_num_{s}": float(n) for s, n in counts.items()} if records else {}
