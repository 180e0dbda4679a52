"""The only module that talks to MLflow.

One parent run per workflow invocation; one nested run per stage (ran or served from cache).
Embedded default: a SQLite store under the work dir (MLflow's file store is in maintenance mode
in 3.x) with artifacts beside it; ``tracking.uri`` / ``MLFLOW_TRACKING_URI`` name a server.
Ray workers log through ``RunLogger`` (picklable: a URI and a run id).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from pipeline import storage
from pipeline.config import Config

log = logging.getLogger(__name__)

_MAX_PARAM_LEN = 6000
EXPERIMENT_KIND_TAG, EXPERIMENT_KIND = "mlflow.experimentKind", "custom_model_development"


def tracking_uri_for(cfg: Config) -> str:
    if cfg.tracking.uri:
        return cfg.tracking.uri
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    if storage.is_remote(cfg.run.work_dir):
        # SQLite needs a local file: keep the store beside the driver, artifacts in the bucket.
        return f"sqlite:///{Path('mlflow.db').resolve()}"
    return f"sqlite:///{storage.absolute(cfg.run.work_dir)}/mlflow.db"


def artifact_location_for(cfg: Config, uri: str) -> str | None:
    """Where a new experiment keeps artifacts: beside the work dir for the embedded store."""
    if uri.startswith("http"):
        return None  # the server decides (--serve-artifacts or its --default-artifact-root)
    return storage.join(storage.absolute(cfg.run.work_dir), "mlartifacts")


def check_reachable(uri: str, timeout_s: float = 5.0) -> None:
    """Fail fast, before any GPU time, when a tracking server does not answer."""
    if not uri.startswith("http"):
        return
    url = uri.rstrip("/") + "/health"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            if r.status != 200:
                raise ConnectionError(f"status {r.status}")
    except (OSError, urllib.error.URLError, ConnectionError) as e:
        raise ConnectionError(f"MLflow tracking server {uri} is not reachable ({e}); "
                              "check tracking.uri / MLFLOW_TRACKING_URI") from e


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = str(v)[:_MAX_PARAM_LEN]
    return out


class RunLogger:
    """Logs to one existing MLflow run from any process (Ray workers): picklable."""

    def __init__(self, tracking_uri: str | None, run_id: str | None):
        self.tracking_uri = tracking_uri
        self.run_id = run_id
        self._client = None

    def __getstate__(self) -> dict[str, Any]:
        return {"tracking_uri": self.tracking_uri, "run_id": self.run_id, "_client": None}

    @property
    def client(self):
        if self._client is None:
            from mlflow import MlflowClient

            self._client = MlflowClient(self.tracking_uri)
        return self._client

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        if not self.run_id or not metrics:
            return
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        batch = [Metric(k, float(v), ts, step or 0) for k, v in metrics.items()]
        self.client.log_batch(self.run_id, metrics=batch)

    def log_params(self, params: dict[str, Any]) -> None:
        if not self.run_id or not params:
            return
        from mlflow.entities import Param

        flat = flatten(params)
        batch = [Param(k, v) for k, v in flat.items()]
        for i in range(0, len(batch), 100):
            self.client.log_batch(self.run_id, params=batch[i:i + 100])

    def set_tags(self, tags: dict[str, str]) -> None:
        for k, v in tags.items():
            if self.run_id:
                self.client.set_tag(self.run_id, k, str(v))

    def log_text(self, text: str, artifact_file: str) -> None:
        if self.run_id:
            self.client.log_text(self.run_id, text, artifact_file)

    def log_artifact(self, local_path: str, artifact_path: str | None = None) -> None:
        if self.run_id:
            self.client.log_artifact(self.run_id, str(local_path), artifact_path)

    def log_artifact_uri(self, uri: str, artifact_path: str | None = None) -> None:
        """Log a file that may live in an object store."""
        if not self.run_id:
            return
        with tempfile.TemporaryDirectory() as tmp:
            name = uri.rstrip("/").rsplit("/", 1)[-1]
            local = Path(tmp) / name
            local.write_bytes(storage.read_bytes(uri))
            self.log_artifact(str(local), artifact_path)


class Tracking:
    """The workflow's MLflow session: a parent run and a nested run per stage."""

    def __init__(self, cfg: Config):
        self.enabled = cfg.tracking.enabled
        self.uri = tracking_uri_for(cfg) if self.enabled else None
        self.cfg = cfg
        self.parent: RunLogger = RunLogger(None, None)
        self._experiment_id: str | None = None

    def _experiment(self) -> str:
        import mlflow

        client = mlflow.MlflowClient(self.uri)
        exp = client.get_experiment_by_name(self.cfg.tracking.experiment)
        if exp is not None:
            return exp.experiment_id
        # MLflow 3's UI opens an experiment without this tag in its GenAI view (traces); this
        # one is model training: runs, params, metric charts (value from MLflow 3.17's UI code).
        return client.create_experiment(self.cfg.tracking.experiment,
                                        artifact_location=artifact_location_for(self.cfg, self.uri),
                                        tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND})

    @contextmanager
    def parent_run(self, tags: dict[str, str]) -> Iterator[RunLogger]:
        if not self.enabled:
            yield self.parent
            return
        import mlflow

        check_reachable(self.uri)
        client = mlflow.MlflowClient(self.uri)
        self._experiment_id = self._experiment()
        run = client.create_run(self._experiment_id, run_name=self.cfg.run.name,
                                tags={"git_commit": git_commit(), **tags})
        self.parent = RunLogger(self.uri, run.info.run_id)
        self.parent.log_params(self.cfg.to_dict())
        self.parent.log_text(_toml_like(self.cfg.to_dict()), "config/resolved.toml")
        status = "FAILED"
        try:
            yield self.parent
            status = "FINISHED"
        finally:
            client.set_terminated(run.info.run_id, status=status)

    @contextmanager
    def stage_run(self, stage: str, key: str, cached: bool, params: dict[str, Any]) -> Iterator[RunLogger]:
        if not self.enabled or not self.parent.run_id:
            yield RunLogger(None, None)
            return
        import mlflow

        client = mlflow.MlflowClient(self.uri)
        tags = {"mlflow.parentRunId": self.parent.run_id, "stage": stage, "cache_key": key,
                "cached": str(cached).lower(), "git_commit": git_commit()}
        run = client.create_run(self._experiment_id, run_name=f"{stage}{' (cached)' if cached else ''}",
                                tags=tags)
        logger = RunLogger(self.uri, run.info.run_id)
        logger.log_params(params)
        self.parent.set_tags({f"cache_key.{stage}": key})
        status = "FAILED"
        try:
            yield logger
            status = "FINISHED"
        finally:
            client.set_terminated(run.info.run_id, status=status)


def _toml_like(d: dict[str, Any]) -> str:
    lines = []
    for section, values in d.items():
        lines.append(f"[{section}]")
        for k, v in values.items():
            lines.append(f"{k} = {json.dumps(v)}")
        lines.append("")
    return "\n".join(lines)
