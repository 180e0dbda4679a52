"""Several configs' DAGs side by side in one driver: the rows of a sweep (workflows/reproduce_table3.py).

The data stages (every stage training reads, transitively) run first, once per distinct set of
their keys. Then each row's own chain (train -> average -> export -> translate -> score) runs as a
branch in a thread of the driver, at most `max_concurrent` at a time. Threads, not Ray tasks: the
runner executes stages in the driver and the heavy work is already on Ray (Ray Train's workers,
Ray Data's actors), so a branch is a thread blocked on Ray; Ray Train's `fit` supports threads
other than the main one (it skips its SIGINT handler there, as under Tune).

Thread safety: the runner keeps no module state; each row has its own plans and its own
`Tracking` (MLflow's client API with explicit run ids; the fluent active-run API is not
thread-safe); rows with the same train key run one after another in one branch, so no two
threads ever write one stage's folder. A row that fails is recorded (the stage and the reason)
and the other rows go on; a rerun finds the finished rows' stages cached and continues the rest.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

from pipeline.config import Config
from pipeline.dag import upstream_closure
from pipeline.stage import Manifest
from workflows import runner

log = logging.getLogger(__name__)

DATA_STAGES = upstream_closure("train")  # download .. encode: shared by the rows of a sweep


@dataclass
class Row:
    name: str
    cfg: Config
    tags: dict[str, str] = field(default_factory=dict)  # on the row's MLflow run and its stage runs


@dataclass(kw_only=True)
class Outcome:
    row: str
    manifests: dict[str, Manifest] | None = None  # None: the row failed
    ran: list[str] = field(default_factory=list)  # the stages this run ran (not cached)
    error: str | None = None
    failed_stage: str | None = None
    started: float = 0.0
    finished: float = 0.0


def rows_that_fit(nodes: list[dict[str, float]], num_workers: int, per_worker: dict[str, float]) -> int:
    """How many rows' worker groups the cluster holds at once (at least 1): a node holds as many
    workers as its scarcest needed resource allows; a row needs `num_workers` of them."""
    slots = 0
    for node in nodes:
        slots += int(min(node.get(k, 0.0) / v for k, v in per_worker.items() if v > 0))
    return max(1, slots // max(1, num_workers))


def default_concurrency(cfgs: list[Config]) -> int:
    """As many rows as the connected Ray cluster holds side by side, each row needing
    `workers.num_workers` workers of its kind (GPU, or `workers.cpus_per_worker` CPUs); a range
    [min, max] counts at its max (what the row trains with when the cluster lets it)."""
    import ray

    from pipeline.batch_plan.step_groups import worker_range
    from pipeline.train.driver import cpus_per_worker, gpu_training

    nodes = [dict(n["Resources"]) for n in ray.nodes() if n.get("Alive")]
    fits = []
    for cfg in cfgs:
        use_gpu = gpu_training(cfg)
        need = {"CPU": float(cpus_per_worker(cfg, use_gpu)), **({"GPU": 1.0} if use_gpu else {})}
        fits.append(rows_that_fit(nodes, worker_range(cfg)[1], need))
    return min(fits, default=1)


def run_data_stages(rows: list[Row], tracking: Any) -> None:
    """The stages every row reads, once per distinct set of keys (all rows share one set unless a
    row changes data.* or vocab.*), before any branch starts: no two branches run them."""
    seen: set[tuple[str, ...]] = set()
    for row in rows:
        keys = runner.keys_in_work_dir(row.cfg)
        signature = tuple(keys[s] for s in DATA_STAGES)
        if signature in seen:
            continue
        seen.add(signature)
        plans = runner.make_plan(row.cfg, to=DATA_STAGES[-1])
        log.info("sweep: data stages (for row %s and the rows sharing them):\n%s", row.name, runner.format_plan(plans))
        runner.execute(row.cfg, plans, tracking)


def branches(rows: list[Row]) -> list[list[Row]]:
    """The rows grouped by train key (in order): one branch per key."""
    groups: dict[str, list[Row]] = {}
    for row in rows:
        groups.setdefault(runner.keys_in_work_dir(row.cfg)["train"], []).append(row)
    return list(groups.values())


def _failed_stage(cfg: Config) -> str | None:
    """The first stage still to run: the one that failed (those before it wrote their manifests)."""
    try:
        return next((p.stage.name for p in runner.make_plan(cfg) if p.action == "run"), None)
    except Exception:  # noqa: BLE001 (only a label for the table; the row's error is what matters)
        return None


def run_row(row: Row, sweep_run_id: str | None) -> Outcome:
    """Plan and run one row's DAG under its own MLflow run, nested in the sweep's; never raises."""
    from pipeline.tracking import Tracking

    out = Outcome(row=row.name, started=time.time())
    try:
        plans = runner.make_plan(row.cfg)
        log.info("sweep: row %s:\n%s", row.name, runner.format_plan(plans))
        tracking = Tracking(row.cfg, label=row.name, tags=row.tags)
        with tracking.parent_run({}, nested_in=sweep_run_id):
            out.manifests = runner.execute(row.cfg, plans, tracking)
        out.ran = sorted(p.stage.name for p in plans if p.action == "run")
    except Exception as e:  # noqa: BLE001 (a failed row must not stop the others)
        log.exception("sweep: row %s failed", row.name)
        out.error, out.failed_stage = f"{type(e).__name__}: {e}", _failed_stage(row.cfg)
    out.finished = time.time()
    log.info("sweep: row %s %s in %.0f s", row.name, "failed" if out.error else "done", out.finished - out.started)
    return out


def _run_branch(rows: list[Row], sweep_run_id: str | None) -> list[Outcome]:
    return [run_row(row, sweep_run_id) for row in rows]


def run_rows(rows: list[Row], max_concurrent: int, sweep_run_id: str | None) -> dict[str, Outcome]:
    """Every row's DAG, `max_concurrent` branches at a time; the outcomes by row name."""
    groups = branches(rows)
    workers = max(1, min(max_concurrent, len(groups)))
    log.info("sweep: %d row(s) in %d branch(es), %d at a time", len(rows), len(groups), workers)
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="row")
    futures: list[Future] = [pool.submit(_run_branch, g, sweep_run_id) for g in groups]
    try:
        wait(futures)
    except BaseException:  # Ctrl-C: start no further branch; the caller's ray.shutdown ends the running ones
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()
    outcomes = {o.row: o for f in futures for o in f.result()}
    return {row.name: outcomes[row.name] for row in rows}
