"""Reaching Ray: the one place that decides which cluster the driver and the stages use."""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path
from typing import Any

from pipeline.config import Config

log = logging.getLogger(__name__)
_REPO = Path(__file__).resolve().parents[1]
_GCS_PORT_ENV = "RAY_GCS_SERVER_PORT"  # read by ray._private.node when a head node starts


def ray_address(cfg: Config) -> str:
    """The rule for which Ray a driver uses: ``run.ray_address``, else ``RAY_ADDRESS`` (set inside a
    submitted job), else "local": a new local Ray that this driver starts and stops. An empty
    address never joins a running cluster: plain ``ray.init()`` would join whatever cluster a
    ``ray start`` on this machine recorded in /tmp/ray (and hang if that one is gone)."""
    return cfg.run.ray_address or os.environ.get("RAY_ADDRESS") or "local"


def ensure_ray(cfg: Config) -> bool:
    """Use the Ray that is already up (the runner's, a test's); else connect to the cluster
    `ray_address` names, or start a new local Ray when it says "local".

    Returns True when this call started a local Ray (the caller stops it).
    """
    import ray

    if ray.is_initialized():
        return False
    address = ray_address(cfg)
    log.info("starting/connecting Ray (address=%r)", address)
    if address != "local":
        ray.init(address=address, log_to_driver=True)
        return False
    start_local_ray(log_to_driver=True)
    return True


def start_local_ray(**init_kwargs: Any) -> str:
    """Start a new local Ray whose own processes know its address; returns that address.

    Ray Train V2 starts a detached ``PlacementGroupCleaner`` actor that asks Ray's State API
    whether the train controller is alive, with no address: Ray then resolves one itself
    (``ray._private.services.canonicalize_bootstrap_address_or_die``: RAY_ADDRESS, else the
    cluster a ``ray start`` recorded, else every GCS process found by ``ps``), and with another
    Ray on the machine it raises "Found multiple active Ray instances" in the cleaner's monitor
    thread (a traceback in the log; the cleaner then never removes the placement group of a
    driver that dies). So the GCS port is chosen here and passed to every worker as RAY_ADDRESS.

    The dashboard stays on (Ray's default): with ``include_dashboard=False`` Ray 2.60 starts the
    dashboard process without its State API module, the cleaner's query then finds no controller
    and removes the placement group of a live run, failing training (seen on this machine).
    """
    import ray

    port = _free_port()
    # Ray starts its workers at nice 15 (so its daemons stay responsive on a busy cluster node).
    # In local mode the workers ARE the job: at nice 15 any other process on the machine takes
    # the CPU first (1024:36 in Linux's CFS weights), and the train stage measured 0.93x a bare
    # torch loop in the same run (docs/benchmarks.md); at 0 they compete as the bare loop does.
    # An idle worker above the soft limit (num_cpus workers) is killed after 1 s by default; local
    # mode's Ray Train actors hold those places, so each dev BLEU validation (a task every checkpoint)
    # started a fresh process and paid its imports (torch, pandas, sacrebleu: ~5 s of a 2-core
    # laptop's CPU, more than the decoding). Idle workers live 2 minutes here (past local mode's
    # checkpoint interval), so a validation reuses the last one's process (docs/benchmarks.md,
    # "dev BLEU in local mode").
    system_config = {"worker_niceness": 0, "idle_worker_killing_time_threshold_ms": 120_000,
                     **init_kwargs.pop("_system_config", {})}
    env_vars = {"PYTHONPATH": str(_REPO), "RAY_ADDRESS": f"127.0.0.1:{port}"}
    runtime_env = dict(init_kwargs.pop("runtime_env", None) or {})
    runtime_env["env_vars"] = {**env_vars, **runtime_env.get("env_vars", {})}
    before = os.environ.get(_GCS_PORT_ENV)
    os.environ[_GCS_PORT_ENV] = str(port)
    try:
        ray.init(address="local", runtime_env=runtime_env, _system_config=system_config, **init_kwargs)
    finally:
        if before is None:
            os.environ.pop(_GCS_PORT_ENV, None)
        else:
            os.environ[_GCS_PORT_ENV] = before
    gcs = ray.get_runtime_context().gcs_address
    if not gcs.endswith(f":{port}"):
        log.warning("Ray started its GCS on %s, not port %d: Ray Train may warn about other Ray "
                    "instances on this machine", gcs, port)
    return gcs


def worker_logging() -> None:
    """The project's INFO lines from inside a Ray worker or task (Ray gives them no handler)."""
    pkg = logging.getLogger("pipeline")
    if not pkg.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s"))
        pkg.addHandler(handler)
    pkg.setLevel(logging.INFO)


def node_cpus() -> list[float]:
    """The CPUs of each alive node of the connected Ray cluster."""
    import ray

    return [n["Resources"].get("CPU", 0) for n in ray.nodes() if n.get("Alive")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
