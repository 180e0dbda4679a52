"""Elastic worker count: `workers.num_workers = [min, max]` on Ray Train 2.60's elastic scaling.

With a range the stage passes `ScalingConfig(num_workers=(min, max),
elastic_resize_monitor_interval_s=workers.elastic_resize_interval_s)`. What Ray Train then does
(ray/train/v2/_internal/execution/scaling_policy/elastic.py, controller.py, failure_handling/):

- It starts (and restarts) the group on as many workers as the cluster can place, between min
  and max; below min it waits.
- A lost node is noticed through its workers: the controller polls them every
  workers.controller_poll_s (2 s; Ray's RAY_TRAIN_HEALTH_CHECK_INTERVAL_S), and a dead worker actor
  (its process gone with its raylet, or its node declared dead by the GCS's health checks) is a
  worker-group error. The group is then restarted from the latest checkpoint on the workers that
  fit. That restart counts against `workers.max_failures` (`FailureConfig.max_failures`) unless Ray
  saw the node drained first (a cloud preemption through the autoscaler: `max_preemption_failures`,
  unlimited by default).
- While running, every elastic_resize_monitor_interval_s it asks whether more workers fit; if so
  it stops the group and restarts it larger from the latest checkpoint. Such a resize is not a
  failure: it uses up nothing.

Every restart resumes from a checkpoint, so work since the latest one is replayed (same steps:
the plan and the per-step seeds do not depend on the worker count; the micro-batch split and the
accumulation are computed from the world size the workers have, `session.world_size`).
"""

from __future__ import annotations

import logging
from typing import Any

from pipeline.batch_plan.step_groups import worker_range
from pipeline.config import Config

log = logging.getLogger(__name__)


class ElasticConfigError(ValueError):
    """`workers.num_workers` cannot work on this cluster; raised before any worker starts."""


def is_elastic(cfg: Config) -> bool:
    lo, hi = worker_range(cfg)
    return isinstance(cfg.workers.num_workers, list) and lo != hi


def scaling_kwargs(cfg: Config) -> dict[str, Any]:
    """The `ScalingConfig` arguments for the worker count."""
    lo, hi = worker_range(cfg)
    if not is_elastic(cfg):
        return {"num_workers": hi}
    return {"num_workers": (lo, hi), "elastic_resize_monitor_interval_s": cfg.workers.elastic_resize_interval_s}


def check_cluster(cfg: Config, nodes: list[dict[str, Any]], use_gpu: bool, cpus_per_worker: int) -> None:
    """With a range: the cluster (`ray.nodes()`, alive ones) must hold `min` workers now, and its
    GPUs must be of one kind (a mixed group would run at the slowest GPU's pace, with bf16 or
    not depending on the node). Errors name workers.num_workers."""
    if not is_elastic(cfg):
        return
    lo, hi = worker_range(cfg)
    alive = [n for n in nodes if n.get("Alive", n.get("alive", True))]
    per_node = [int(n["Resources"].get("GPU", 0)) if use_gpu else int(n["Resources"].get("CPU", 0) // cpus_per_worker)
                for n in alive]
    fits = sum(per_node)
    if fits < lo:
        raise ElasticConfigError(
            f"workers.num_workers = [{lo}, {hi}]: the Ray cluster holds {fits} {'GPU' if use_gpu else 'CPU'} "
            f"worker(s) now ({cpus_per_worker} CPU(s) each{', 1 GPU each' if use_gpu else ''}), fewer than the "
            "minimum: lower the minimum or add nodes")
    if use_gpu:
        kinds = sorted({k.split(":", 1)[1] for n in alive if n["Resources"].get("GPU", 0)
                        for k in n["Resources"] if k.startswith("accelerator_type:")})
        if len(kinds) > 1:
            raise ElasticConfigError(
                f"workers.num_workers = [{lo}, {hi}] with workers.use_gpu: the cluster's GPUs are of different kinds "
                f"({', '.join(kinds)}); an elastic group could mix them. Use one GPU type per cluster")


def log_start(tracker: Any, rank: int, step: int, world: int, accum: int, previous_world: int | None) -> None:
    """Rank 0 at each (re)start: world size and accumulation at the resume step, in MLflow, and
    one line saying why the size changed."""
    if rank != 0:
        return
    if previous_world is not None and previous_world != world:
        why = ("shrank: a worker or its node was lost and Ray Train restarted the group on the workers it could "
               "place" if world < previous_world else
               "grew: capacity came back and Ray Train's resize check (workers.elastic_resize_interval_s) restarted "
               "the group larger")
        log.warning("elastic: resumed at step %d on %d worker(s), %d at the checkpoint: the group %s; "
                    "%d micro-batch(es) per worker", step, world, previous_world, why, accum)
    if tracker is not None:
        tracker.log_metrics({"train/world_size": float(world), "train/accum": float(accum)}, step=step)
