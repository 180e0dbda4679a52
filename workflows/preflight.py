"""Checks both entry scripts run before any GPU time (reproduce_base.py, reproduce_table3.py)."""

from __future__ import annotations

import logging

from pipeline import storage
from pipeline.config import Config, ConfigError

log = logging.getLogger(__name__)


def preflight(cfg: Config, write: bool = True, check_tracking: bool = True) -> None:
    """Clear errors before any GPU time: the work dir (and Ray Train's storage path) can be
    written (with ``write=False``, read: enough for ``--plan``), tracking answers."""
    from pipeline import tracking

    for key in ("work_dir", "storage_path"):
        uri = getattr(cfg.run, key)
        if not uri:
            continue
        try:
            storage.check_access(uri, write=write)
        except OSError as e:
            raise ConfigError(f"run.{key}: {e}") from e
    if cfg.tracking.enabled and check_tracking:
        uri = tracking.tracking_uri_for(cfg)
        tracking.check_reachable(uri)
        if storage.is_remote(cfg.run.work_dir) and uri.startswith("sqlite:"):
            log.warning("tracking: the work dir is on an object store but MLflow writes to %s on this "
                        "machine only; set tracking.uri or MLFLOW_TRACKING_URI to a server to keep the runs",
                        uri)
