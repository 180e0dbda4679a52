"""Which MLflow store a config names, where a new experiment keeps artifacts, and a fast check
that a tracking server answers (before any GPU time)."""

from __future__ import annotations

import os
import urllib.error
import urllib.request
from pathlib import Path

from pipeline import storage
from pipeline.config import Config


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
