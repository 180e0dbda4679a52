"""Reaching Ray: the one place that decides which cluster the driver and the stages use."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from pipeline.config import Config

log = logging.getLogger(__name__)
_REPO = Path(__file__).resolve().parents[1]


def ensure_ray(cfg: Config) -> bool:
    """Use the Ray that is already up (the runner's, a test's); else connect or start one.

    ``run.ray_address`` (or ``RAY_ADDRESS``, set inside a submitted job) names a cluster; without
    either, a new local Ray is started: plain ``ray.init()`` would join whatever cluster a
    ``ray start`` on this machine recorded in /tmp/ray (and hang if that one is gone).
    Returns True when this call started a local Ray (the caller stops it).
    """
    import ray

    if ray.is_initialized():
        return False
    address = cfg.run.ray_address or os.environ.get("RAY_ADDRESS") or "local"
    log.info("starting/connecting Ray (address=%r)", address)
    if address != "local":
        ray.init(address=address, log_to_driver=True)
        return False
    ray.init(address="local", runtime_env={"env_vars": {"PYTHONPATH": str(_REPO)}}, log_to_driver=True)
    return True
