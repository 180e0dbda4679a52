"""Reaching Ray: the one place that decides which cluster the driver and the stages use."""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Cluster:
    """A Ray cluster as a run's needs are weighed against it (workflows/preflight.py, the train
    stage's device): its alive nodes now, and the node types its autoscaler may add (none: the
    cluster stays as it is)."""

    hosts: frozenset[str]  # the alive nodes' IP addresses
    nodes: tuple[dict[str, float], ...]  # each alive node's resources
    node_types: tuple[tuple[dict[str, float], int], ...] = ()  # (a node's resources, the most of them)

    @property
    def multi_host(self) -> bool:
        return len(self.hosts) > 1 or sum(most for _, most in self.node_types) > 1

    def most(self, name: str) -> float:
        """The most of resource `name` the cluster has now or can grow to."""
        return max(sum(n.get(name, 0.0) for n in self.nodes), sum(r.get(name, 0.0) * k for r, k in self.node_types))

    def placeable(self, each: dict[str, float]) -> int:
        """How many tasks or actors asking `each` fit at once, each on one node, now or grown."""
        def on(node: dict[str, float]) -> int:
            return min((int(node.get(k, 0.0) // v) for k, v in each.items() if v > 0), default=1_000_000)
        return max(sum(on(n) for n in self.nodes), sum(on(r) * k for r, k in self.node_types))

    def describe(self) -> str:
        totals = ", ".join(f"{self.most(k):g} {k}" for k in ("GPU", "CPU") if self.most(k))
        grows = "at its autoscaler's maximum" if self.node_types else "and no autoscaler to add nodes"
        return f"{len(self.nodes)} node(s) on {len(self.hosts)} host(s), {totals or 'nothing'} {grows}"


def _node_types() -> tuple[tuple[dict[str, float], int], ...]:
    """The autoscaler's node types from the GCS, as Ray Train's own check reads them
    (`ray._private.state`); () without an autoscaler."""
    import ray
    from ray._private import state

    config = state.state.get_cluster_config() if ray.is_initialized() else None
    return tuple((dict(g.resources), int(g.max_count)) for g in (config.node_group_configs if config else ()))


def connected_cluster() -> Cluster:
    """The `Cluster` of the Ray this driver is connected to: `ray.nodes()` and the autoscaler's node types."""
    import ray

    alive = [n for n in ray.nodes() if n.get("Alive")]
    return Cluster(frozenset(n.get("NodeManagerAddress", "") for n in alive),
                   tuple(dict(n["Resources"]) for n in alive), _node_types())


def cluster_gpus() -> float:
    """The GPUs of the connected cluster now (`ray.cluster_resources()`), or at its autoscaler's
    maximum where that is more: what `"auto"` and `true` of a stage's `use_gpu` are decided on."""
    import ray

    return max(ray.cluster_resources().get("GPU", 0.0), sum(r.get("GPU", 0.0) * k for r, k in _node_types()))
