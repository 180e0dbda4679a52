"""The workflow's MLflow session (`Tracking`): the parent run per invocation, one run per (stage,
cache key), continued after a crash; `end_dead_runs` ends a dead driver's runs. `WorkDirRuns` finds
this work dir's runs in the experiment (and makes the experiment)."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from pipeline import storage
from pipeline.config import Config
from pipeline.tracking.client import BoundedClient, short_error
from pipeline.tracking.loggers import RunLogger
from pipeline.tracking.spool import deliver_spool, spool_dir_for, spooled_run_ids
from pipeline.tracking.uri import artifact_location_for, check_reachable, tracking_uri_for

log = logging.getLogger("pipeline.tracking")  # one logger name for the package: one switch for all its messages

EXPERIMENT_KIND_TAG, EXPERIMENT_KIND = "mlflow.experimentKind", "custom_model_development"


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"



class WorkDirRuns:
    """This work dir's runs in the config's experiment (created on first use), read and made
    through clients whose calls give up after ``tracking.timeout_s``."""

    def __init__(self, cfg: Config, uri: str | None):
        self.cfg, self.uri, self.timeout_s = cfg, uri, cfg.tracking.timeout_s
        self.work_dir = storage.absolute(cfg.run.work_dir)
        self._experiment_id: str | None = None

    def client(self) -> BoundedClient:
        return BoundedClient(self.uri, self.timeout_s)

    def experiment_id(self) -> str:
        if self._experiment_id is not None:
            return self._experiment_id
        client = self.client()
        exp = client.get_experiment_by_name(self.cfg.tracking.experiment)
        if exp is None:
            # MLflow 3's UI opens an experiment without this tag in its GenAI view (traces); this
            # one is model training: runs, params, metric charts (value from MLflow 3.17's UI code).
            self._experiment_id = client.create_experiment(
                self.cfg.tracking.experiment, artifact_location=artifact_location_for(self.cfg, self.uri),
                tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND})
        else:
            self._experiment_id = exp.experiment_id
        return self._experiment_id

    def search(self, filter_string: str) -> list[Any]:
        """This work dir's runs matching `filter_string`, newest first (the work dir is compared
        here, not in the filter: a path may hold quotes)."""
        runs = self.client().search_runs(
            [self.experiment_id()], filter_string, max_results=1000, order_by=["attributes.start_time DESC"])
        return [r for r in runs if r.data.tags.get("work_dir") == self.work_dir]

    def previous_stage_run(self, stage: str, key: str) -> Any | None:
        """The newest run that did (or tried to do) this stage's work at this key, if any."""
        runs = self.search(f"tags.stage = '{stage}' and tags.cache_key = '{key}' and tags.cached = 'false'")
        return runs[0] if runs else None


@contextmanager
def _terminated_after(client: BoundedClient, run_id: str) -> Iterator[None]:
    """End the run when the block ends: FINISHED, or FAILED when it raised."""
    status = "FAILED"
    try:
        yield
        status = "FINISHED"
    finally:
        client.set_terminated(run_id, status=status)


class Tracking:
    """The workflow's MLflow session: a parent run per invocation, one run per (stage, cache key).

    A stage run is tagged with the work dir, the stage and its cache key. A rerun of a stage that
    did not finish (killed driver: ended as KILLED by `end_dead_runs`; a failure: FAILED) continues
    the same run, so its curves stay one curve; the new parent adopts it (`mlflow.parentRunId`) and
    tags `stage_run.<stage>` with its id. Stages served from cache get a small nested run
    (`cached=true`) that names the run which produced them (`source_run_id`).
    """

    def __init__(self, cfg: Config, label: str = "", tags: dict[str, str] | None = None):
        """`label` prefixes the names of the stage runs ("B1: train"); `tags` go on the parent run
        and on every stage run (e.g. a Table 3 row's ``table3_row``), so runs can be filtered by them."""
        self.label = label
        self.tags = dict(tags or {})
        self.enabled = cfg.tracking.enabled
        self.uri = tracking_uri_for(cfg) if self.enabled else None
        self.cfg = cfg
        self.timeout_s = cfg.tracking.timeout_s
        self.runs = WorkDirRuns(cfg, self.uri)
        self.driver = f"{socket.gethostname()} pid {os.getpid()}"
        self.parent: RunLogger = RunLogger(None, None)

    def end_dead_runs(self) -> list[str]:
        """End the RUNNING runs of this work dir as KILLED, with an `end_reason` tag; their ids.

        Call only while holding the work-dir lock (workflows/lock.py): one driver per work dir, so
        a run of this work dir still RUNNING then belongs to a driver that died (kill -9, a lost
        node) before it could end its runs."""
        if not self.enabled:
            return []
        check_reachable(self.uri)
        client = self.runs.client()
        ended = []
        for run in self.runs.search("attributes.status = 'RUNNING'"):
            owner = run.data.tags.get("driver", "an unknown driver")
            reason = (f"its driver ({owner}) died without ending it; found RUNNING at "
                      f"{time.strftime('%Y-%m-%dT%H:%M:%S')} by {self.driver}, which holds the work-dir lock")
            client.set_tag(run.info.run_id, "end_reason", reason)
            client.set_terminated(run.info.run_id, status="KILLED")
            ended.append(run.info.run_id)
            log.warning("tracking: ended MLflow run %s (%s) as KILLED: %s", run.info.run_id,
                        run.info.run_name, reason)
        self.deliver_spools()
        return ended

    def deliver_spools(self) -> int:
        """Deliver the metric points that workers spooled when training ended during an outage
        (`BufferedRunLogger`) and no one has delivered since; how many there were. Runs still
        RUNNING are left to their own stage. Never fails the invocation: what the server does not
        take stays spooled (a warning says so)."""
        if not self.enabled:
            return 0
        root = spool_dir_for(self.cfg)
        try:
            run_ids = spooled_run_ids(root)
        except Exception as e:  # noqa: BLE001 (the storage is away: the next invocation tries again)
            log.warning("tracking: could not list the metric spool %s (%s)", root, short_error(e))
            return 0
        total = 0
        for run_id in run_ids:
            try:
                status = self.runs.client().get_run(run_id).info.status
            except Exception as e:  # noqa: BLE001 (a run of another store, deleted, or the server is away)
                log.warning("tracking: spooled metrics of run %s stay in %s (%s)", run_id, root, short_error(e))
                continue
            if status != "RUNNING":
                total += deliver_spool(root, self.uri, run_id, self.timeout_s)
        return total

    def _base_tags(self) -> dict[str, str]:
        return {"git_commit": git_commit(), "work_dir": self.runs.work_dir, "driver": self.driver, **self.tags}

    @contextmanager
    def parent_run(self, tags: dict[str, str], run_name: str | None = None,
                   nested_in: str | None = None) -> Iterator[RunLogger]:
        """This invocation's run (named `run_name`, default ``run.name``), the parent of the stage
        runs; with `nested_in` (a run id) itself nested in that run, e.g. a sweep's row in the sweep.
        Only the client API with explicit run ids is used: several parents may be open at once,
        one per thread (MLflow's fluent active-run API is not thread-safe)."""
        if not self.enabled:
            yield self.parent
            return
        check_reachable(self.uri)
        client = self.runs.client()
        nested = {"mlflow.parentRunId": nested_in} if nested_in else {}
        run = client.create_run(self.runs.experiment_id(), run_name=run_name or self.cfg.run.name,
                                tags={**self._base_tags(), **nested, **tags})
        self.parent = RunLogger(self.uri, run.info.run_id, self.timeout_s)
        self.parent.log_params(self.cfg.to_dict())
        self.parent.log_text(_toml_like(self.cfg.to_dict()), "config/resolved.toml")
        with _terminated_after(client, run.info.run_id):
            yield self.parent

    @contextmanager
    def stage_run(self, stage: str, key: str, cached: bool, params: dict[str, Any],
                  fresh: bool = False) -> Iterator[RunLogger]:
        """The stage's run: a continued one when its last run at this key ended unfinished (unless
        `fresh`, e.g. --force: the work restarts from scratch), else a new one."""
        if not self.enabled or not self.parent.run_id:
            yield RunLogger(None, None)
            return
        client = self.runs.client()
        previous = self.runs.previous_stage_run(stage, key)
        tags = {"mlflow.parentRunId": self.parent.run_id, "stage": stage, "cache_key": key,
                "cached": str(cached).lower(), **self._base_tags()}
        if cached and previous is not None:
            tags["source_run_id"] = previous.info.run_id
        if not cached and not fresh and previous is not None and previous.info.status in ("KILLED", "FAILED"):
            logger = self._continue_run(client, previous, stage, tags)
        else:
            logger = self._new_stage_run(client, stage, cached, tags, params)
        self.parent.set_tags({f"cache_key.{stage}": key,
                              f"stage_run.{stage}": tags.get("source_run_id", logger.run_id)})
        with _terminated_after(client, logger.run_id):
            yield logger

    def _continue_run(self, client: BoundedClient, previous: Any, stage: str, tags: dict[str, str]) -> RunLogger:
        """`previous` (ended KILLED or FAILED) running again as this invocation's, its attempt counted."""
        run_id = previous.info.run_id
        attempt = int(previous.data.tags.get("attempts", "1")) + 1
        client.update_run(run_id, status="RUNNING")
        for k, v in {**tags, "attempts": str(attempt), "continued_from_status": previous.info.status,
                     f"parent_run.{attempt}": self.parent.run_id}.items():
            client.set_tag(run_id, k, v)
        log.info("tracking: stage %s continues MLflow run %s (attempt %d; it ended %s)", stage, run_id,
                 attempt, previous.info.status)
        return RunLogger(self.uri, run_id, self.timeout_s)

    def _new_stage_run(self, client: BoundedClient, stage: str, cached: bool, tags: dict[str, str],
                       params: dict[str, Any]) -> RunLogger:
        if not cached:
            tags = {**tags, "attempts": "1", "parent_run.1": self.parent.run_id}
        name = f"{self.label}: {stage}" if self.label else stage
        run = client.create_run(self.runs.experiment_id(), run_name=f"{name}{' (cached)' if cached else ''}",
                                tags=tags)
        logger = RunLogger(self.uri, run.info.run_id, self.timeout_s)
        logger.log_params(params)
        return logger


def _toml_like(d: dict[str, Any]) -> str:
    lines = []
    for section, values in d.items():
        lines.append(f"[{section}]")
        for k, v in values.items():
            lines.append(f"{k} = {json.dumps(v)}")
        lines.append("")
    return "\n".join(lines)
