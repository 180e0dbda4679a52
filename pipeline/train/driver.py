"""``train``: the Transformer on the encoded shards with Ray Train (TorchTrainer, DDP).

Driver side (this module, the DAG's `train` entry): checks the inputs before any worker starts
(`inputs`: ids within the vocabulary, a non-empty training set, budgets that hold the longest pair), logs
the stage's bill (`pipeline.plan.train_bill`) as its run's params, builds the `TorchTrainer`, and
turns its `Result` into the stage's outputs (docs/stages.md) and plots. Beside it on the driver:
`elastic` (the worker range), `resume` (the run folder), `dev_bleu_validation` (dev BLEU per
checkpoint). Worker side: `pipeline.train.loop` (the loop) and its parts, on the global batch plan
of `pipeline.batch_plan.step_groups`.

Resume. The Ray Train run is named after the stage's cache key and lives under
`run.storage_path` (default `<work_dir>/ray_train`). Ray Train V2 keeps a checkpoint-manager
snapshot in that folder and, when a new `TorchTrainer` starts with the same
`RunConfig(name, storage_path)`, loads it: `ray.train.get_checkpoint()` in the workers returns the
latest checkpoint. So a worker failure (`FailureConfig.max_failures`) and a killed-and-restarted
driver both continue from the latest checkpoint; at most one checkpoint interval is lost.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from model import ModelConfig
from pipeline import storage
from pipeline.batch_plan.step_groups import worker_range
from pipeline.config import Config
from pipeline.config.devices import use_gpus
from pipeline.decoding.selection import kept_shortfall
from pipeline.models import model_config_for
from pipeline.plan.train_bill import train_bill
from pipeline.ray_env import cluster_gpus, ensure_ray, node_cpus, worker_logging
from pipeline.stage import StageContext, StageResult
from pipeline.tracking import deliver_spool, spool_dir_for
from pipeline.train import checkpoint as train_checkpoint
from pipeline.train import dev_bleu_validation, elastic, preemption
from pipeline.train.corpus import load_lengths
from pipeline.train.inputs import check_early_stop, preflight
from pipeline.train.loop import LoopSpec, train_worker
from pipeline.train.device import describe as describe_precision
from pipeline.train.device import resolve_precision
from pipeline.train.resume import storage_path_for
from pipeline.train.session import SESSION_WRAPPER_ENV, RaySession

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# Ray wiring (the only part of the stage that imports Ray)


def _session_wrapper() -> str:
    """`SESSION_WRAPPER_ENV` of the driver, for the workers (Ray workers on other nodes do not
    inherit the driver's environment): tests install fault injection this way."""
    value = os.environ.get(SESSION_WRAPPER_ENV, "")
    if value:
        log.warning("train: %s=%s wraps every worker's session", SESSION_WRAPPER_ENV, value)
    return value


# Ray Train V2's controller poll interval (ray.train.v2._internal.constants; workers.controller_poll_s),
# and its value in this driver's environment before we set it (a user's explicit choice wins).
CONTROLLER_POLL_ENV = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"
_USER_CONTROLLER_POLL = os.environ.get(CONTROLLER_POLL_ENV, "")


def controller_poll_s(cfg: Config) -> str:
    """What Ray Train's controller polls at: the driver's RAY_TRAIN_HEALTH_CHECK_INTERVAL_S when the
    user set one, else workers.controller_poll_s."""
    return _USER_CONTROLLER_POLL or str(cfg.workers.controller_poll_s)


def train_fn_per_worker(config: dict[str, Any]) -> dict[str, Any]:
    """What every Ray Train worker runs."""
    worker_logging()
    validate = bool(config.pop("dev_bleu", False))  # set by `fit` when it gives a validation_config
    retry_s = config["cfg"]["checkpoint"]["upload_retry_s"]
    return train_worker(config, RaySession(validate, upload_retry_s=retry_s))


def forget_run(cfg: Config, key: str) -> None:
    """Delete the Ray Train run of cache key `key` (checkpoints and snapshot): the next `run`
    starts from step 0. For `--force train`; without it a rerun resumes (and, if finished, ends
    at once)."""
    storage.rmtree(storage.join(storage_path_for(cfg), key))


def gpu_training(cfg: Config) -> bool:
    """Train on GPUs: `workers.use_gpu` against the (already connected) Ray cluster ("auto": when it
    has one, or its autoscaler can add one; true without either is a ConfigError)."""
    return use_gpus(cfg.workers.use_gpu, cluster_gpus(), "workers.use_gpu")


def cpus_per_worker(cfg: Config, use_gpu: bool, per_node: list[float] | None = None) -> int:
    """CPUs each worker reserves and uses as torch threads (`workers.cpus_per_worker`, 0 = auto);
    `per_node`: each node's CPUs (None: the connected Ray cluster's; `--plan`'s bill passes this
    machine's, the node a local run trains on).

    Auto on CPU: the cluster's CPUs shared out over the workers, at most one node's worth, so a
    laptop's training uses every core (Ray would otherwise give a worker 1 CPU, hence 1 thread).
    Auto on GPU: 1 (the GPU does the work; the rest stays free for Ray Data stages)."""
    if cfg.workers.cpus_per_worker > 0:
        return cfg.workers.cpus_per_worker
    if use_gpu:
        return 1
    per_node = node_cpus() if per_node is None else per_node
    # Left free for the dev BLEU task (dev_bleu.resources), which would else wait for the end.
    spare = dev_bleu_validation.reserved_cpus(cfg)
    total, largest = sum(per_node) - spare, max(per_node, default=1) - spare
    # A range: shared out over the most workers, so that the largest group fits.
    return max(1, int(min(total // worker_range(cfg)[1], largest)))


def local_cpu_training(cfg: Config) -> tuple[str, int]:
    """(precision, torch threads) of a CPU worker of a local run on this machine: what `--plan`
    bills a CPU run at (pipeline/plan/cpu_bill.py). The same rules as the run's: `speed.precision`
    on this CPU, `cpus_per_worker` over this machine's CPUs."""
    return (resolve_precision(cfg.speed.precision, torch.device("cpu")),
            cpus_per_worker(cfg, False, [float(os.cpu_count() or 1)]))


def fit(cfg: Config, spec: LoopSpec, run_name: str, storage_path: str, validation: Any = None) -> Any:
    """Run (or resume) the Ray Train run `run_name`; the `Result`. `validation`: a Ray Train
    ``ValidationConfig`` (dev BLEU per checkpoint, pipeline/train/dev_bleu_validation.py) or None."""
    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    ensure_ray(cfg)
    wc = cfg.workers
    use_gpu = gpu_training(cfg)
    if wc.use_gpu == "auto":
        log.info("workers.use_gpu = auto: the Ray cluster has %s GPU: training on %s",
                 "a" if use_gpu else "no", "GPUs" if use_gpu else "CPUs")
    if not use_gpu:  # a bad speed.precision fails here, before any worker starts (this CPU decides)
        log.info("train: %s", describe_precision(cfg.speed.precision, torch.device("cpu")))
    cpus = cpus_per_worker(cfg, use_gpu)
    elastic.check_cluster(cfg, ray.nodes(), use_gpu, cpus)
    spec.num_threads = 0 if use_gpu else cpus
    # Ray Train hands this variable from the driver's environment to its controller (and workers).
    os.environ[CONTROLLER_POLL_ENV] = controller_poll_s(cfg)
    trainer = TorchTrainer(
        train_fn_per_worker,
        train_loop_config={**spec.to_dict(), "dev_bleu": validation is not None},
        validation_config=validation,
        torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo"),
        scaling_config=ScalingConfig(**elastic.scaling_kwargs(cfg), use_gpu=use_gpu,
                                     resources_per_worker={"CPU": cpus, **({"GPU": 1} if use_gpu else {})},
                                     placement_strategy=wc.placement_strategy),
        run_config=RunConfig(
            name=run_name, storage_path=storage_path,
            failure_config=FailureConfig(max_failures=wc.max_failures),
            callbacks=[preemption.ray_worker_callback()] if wc.preemption_grace_s else [],
            checkpoint_config=CheckpointConfig(num_to_keep=cfg.checkpoint.num_to_keep)),
    )
    log.info("train: Ray Train run %s under %s, %s %s worker(s), %d CPU(s) each; its controller polls every %s s",
             run_name, storage_path, wc.num_workers, "GPU" if use_gpu else "CPU", cpus, os.environ[CONTROLLER_POLL_ENV])
    return trainer.fit()


def checkpoint_uris(result: Any, storage_path: str) -> list[str]:
    """The kept checkpoints of a finished run, oldest first, as URIs (complete ones only)."""
    pairs = sorted(result.best_checkpoints or [], key=lambda cm: cm[1].get("step", 0))
    scheme = storage_path.split("://", 1)[0] + "://" if storage.is_remote(storage_path) else ""
    uris = [f"{scheme}{ckpt.path}" for ckpt, _ in pairs]
    return [u for u in uris if all(storage.exists(storage.join(u, f)) for f in train_checkpoint.FILES)]


# ---------------------------------------------------------------------------------------------
# The stage


def run(ctx: StageContext) -> StageResult:
    cfg = ctx.cfg
    encode, vocab = ctx.inputs["encode"].outputs, ctx.inputs["vocab"].outputs
    mc = model_config_for(cfg, vocab)
    train_dir = encode["splits"]["train"]["dir"]
    dev_dir = encode["splits"].get("dev", {}).get("dir", "")
    lengths = load_lengths(train_dir)  # read once: the checks and the bill
    stats = preflight(cfg, mc, train_dir, dev_dir, lengths)
    spec = LoopSpec(cfg=cfg.to_dict(), model_config=mc.to_dict(), train_dir=storage.absolute(train_dir),
                    dev_dir=storage.absolute(dev_dir) if dev_dir else "",
                    tracking_uri=getattr(ctx.tracker, "tracking_uri", None),
                    run_id=getattr(ctx.tracker, "run_id", None), session_wrapper=_session_wrapper())
    storage_path = storage_path_for(cfg)
    run_dir = storage.join(storage_path, ctx.key)
    validation = dev_bleu_validation.validation_config(cfg, dev_dir=dev_dir, vocab=vocab, run_dir=run_dir,
                                                       tracking_uri=spec.tracking_uri, run_id=spec.run_id)
    spec.dev_bleu_dir = storage.absolute(run_dir) if validation is not None else ""
    check_early_stop(cfg, dev_dir, vocab)
    _log_bill(ctx, mc, lengths)
    t0 = time.time()
    result = fit(cfg, spec, ctx.key, storage_path, validation)
    summary = result.return_value or {}
    # Metric points the workers could not deliver (the tracking server away as training ended),
    # spooled beside the checkpoints: delivered now, else by the next invocation (pipeline.tracking).
    pending_points = deliver_spool(spool_dir_for(cfg), spec.tracking_uri, spec.run_id, cfg.tracking.timeout_s)
    checkpoints = checkpoint_uris(result, storage_path)
    if not checkpoints:
        raise RuntimeError(f"train: the run {ctx.key} under {storage_path} finished without a checkpoint")
    final_step = int(summary.get("final_step") or train_checkpoint_step(checkpoints[-1]))
    dev, dev_metrics = dev_bleu_validation.summarize(run_dir, cfg, dev_dir, vocab)
    _log_end(cfg, summary, final_step, len(checkpoints))
    history = {"train": summary.get("history_train", []), "val": summary.get("history_val", [])}
    ctx.tracker.set_tags({"train.precision_used": str(summary.get("precision"))})  # what "auto" became
    storage.write_json(storage.join(ctx.out_dir, "history.json"), history)
    _log_plots(ctx, history)
    # A run resumed at its last step trains nothing: its metrics are the last checkpoint's.
    # Renamed (val/loss -> val/final_loss): the runner logs these at step 0, which must not
    # add a point to the workers' val/loss curve.
    last = summary.get("last_metrics") or dict(result.metrics or {})
    metrics = {"train/final_step": float(final_step),
               "train/num_dropped_too_long": float(stats["num_dropped_too_long"]),
               "train/wall_s": float(summary.get("train_time_s", 0.0)),
               "train/driver_wall_s": time.time() - t0,
               **{f"val/final_{k[4:]}": float(v) for k, v in last.items() if k.startswith("val/")}, **dev_metrics}
    outputs = {"checkpoints": checkpoints, "final_step": final_step, "run_name": ctx.key,
               "storage_path": storage_path, "model_config": mc.to_dict(), "data": stats, "dev_bleu": dev,
               "tracking_pending_points": pending_points,  # spooled at the end of training (see above)
               **_summary_outputs(cfg, summary)}
    return StageResult(outputs=outputs, metrics=metrics)


def _log_end(cfg: Config, summary: dict[str, Any], final_step: int, num_checkpoints: int) -> None:
    """Why the run ended early (if it did), a shortfall of kept checkpoints, what it saw."""
    early = summary.get("early_stop") or None
    if early:
        log.info("train: stopped early at step %d of %d: %s did not improve for %d validation(s) (best %s at step %s)",
                 early["step"], early["max_steps"], early["metric"], early["num_bad"], early["best"],
                 early["best_step"])
    shortfall = kept_shortfall(cfg, num_checkpoints)
    if shortfall:
        log.warning("train: %s", shortfall)
    tokens = summary.get("tokens_seen", {"src": 0, "tgt": 0})
    log.info("train: done at step %d, %d checkpoint(s) kept, %d target tokens seen", final_step, num_checkpoints,
             tokens["tgt"])


def _summary_outputs(cfg: Config, summary: dict[str, Any]) -> dict[str, Any]:
    """The stage's outputs taken from the workers' summary (rank 0's)."""
    on_gpu = gpu_training(cfg)
    train_time_s = float(summary.get("train_time_s", 0.0))
    return {"tokens_seen": summary.get("tokens_seen", {"src": 0, "tgt": 0}), "wall_s": train_time_s,
            "precision": summary.get("precision"),
            "resumed_from_step": int(summary.get("start_step", 0)),
            "early_stop": summary.get("early_stop") or None,  # None, or where and why early stopping ended the run
            # For the score report: the compute this result cost (loop time x workers).
            # The last attempt's group (an elastic run may have changed size on the way).
            "num_workers": int(summary.get("world_size") or worker_range(cfg)[1]),
            "device": "GPU" if on_gpu else "CPU",
            "gpu_hours": train_time_s * int(summary.get("world_size") or 1) / 3600 if on_gpu else 0.0}


def _log_bill(ctx: StageContext, mc: ModelConfig, lengths: tuple[np.ndarray, np.ndarray]) -> None:
    """The train stage's bill (pipeline/plan/train_bill.py) as the run's MLflow params; never fails training."""
    try:
        b = train_bill(ctx.cfg, mc, lambda: local_cpu_training(ctx.cfg), lengths)
        log.info("train: the %s: %.4g FLOPs per step, %.3g h", b.format().splitlines()[0], b.flops_per_step, b.hours)
        ctx.tracker.log_params(b.params())
    except Exception as e:  # noqa: BLE001 (an unknown gpu_type, a changed MLflow param): a note, not a failure
        log.warning("train: no bill in the run's params (%s: %s)", type(e).__name__, e)


def train_checkpoint_step(uri: str) -> int:
    return int(json.loads(storage.read_text(storage.join(uri, train_checkpoint.META_FILE)))["step"])


def _log_plots(ctx: StageContext, history: dict[str, list[list[float]]]) -> None:
    """Loss curves (train and val) and the lr schedule as PNGs: in the out dir and in MLflow."""
    if not history["train"]:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = np.asarray(history["train"], dtype=float)
    val = np.asarray(history["val"], dtype=float).reshape(-1, 3)
    with tempfile.TemporaryDirectory() as tmp:
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot(train[:, 0], train[:, 1], label="train loss (label-smoothed)")
        ax.plot(train[:, 0], train[:, 2], label="train nll", alpha=0.6)
        if len(val):
            ax.plot(val[:, 0], val[:, 1], "o-", label="val loss (label-smoothed)")
            ax.plot(val[:, 0], val[:, 2], "s--", label="val nll")
        ax.set_xlabel("step")
        ax.set_ylabel("nats per target token")
        ax.legend()
        fig.tight_layout()
        fig.savefig(Path(tmp) / "loss.png", dpi=100)
        plt.close(fig)
        fig, ax = plt.subplots(figsize=(7, 3))
        ax.plot(train[:, 0], train[:, 3])
        ax.set_xlabel("step")
        ax.set_ylabel("learning rate")
        fig.tight_layout()
        fig.savefig(Path(tmp) / "lr.png", dpi=100)
        plt.close(fig)
        for name in ("loss.png", "lr.png"):
            storage.upload(Path(tmp) / name, storage.join(ctx.out_dir, "plots", name))
            ctx.tracker.log_artifact(str(Path(tmp) / name), "plots")
