"""The driver's session, one for both entry scripts (reproduce_base.py, reproduce_table3.py).

    with driver_session(cfg) as session:              # the work-dir lock, then Ray
        with session.parent_run({"argv": ...}) as tracking:  # dead runs ended, the parent run open
            runner.execute(cfg, plans, tracking)

On the way out, in reverse: the parent run ends (FINISHED, or FAILED when the body raised), the
lock is released, and a local Ray that the session started is shut down. Errors propagate: each
script turns the ones it expects into its message and exit code. The checks of the config and its
storage (`workflows.preflight.preflight`) run before the session, as they also serve ``--plan``,
which takes no lock and starts no Ray; those of the cluster (`check_cluster`: workers it can never
place, storage its other hosts can't see) run here, as soon as Ray is reached.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Collection, Iterator

from pipeline.config import Config
from pipeline.dag import ORDER
from pipeline.ray_env import ensure_ray
from workflows.lock import WorkDirLock
from workflows.preflight import check_ray


class DriverSession:
    """What `driver_session` holds: the config whose work dir is locked."""

    def __init__(self, cfg: Config):
        self.cfg = cfg

    @contextmanager
    def parent_run(self, parent_tags: dict[str, str], *, cfg: Config | None = None,
                   tracking_tags: dict[str, str] | None = None, run_name: str | None = None) -> Iterator[Any]:
        """This invocation's MLflow session (a `pipeline.tracking.Tracking` for `cfg`, default the
        session's, with `tracking_tags` on every run), after ending the runs a dead driver left
        RUNNING, with its parent run open (tagged `parent_tags`, named `run_name`, default
        ``run.name``); the Tracking, whose ``parent`` is that run's logger."""
        from pipeline.tracking import Tracking

        tracking = Tracking(cfg or self.cfg, tags=tracking_tags)
        tracking.end_dead_runs()  # under the lock: RUNNING runs of this work dir are a dead driver's
        with tracking.parent_run(parent_tags, run_name=run_name):
            yield tracking


@contextmanager
def driver_session(cfg: Config, start_ray: bool = True, runs: Collection[str] = ORDER) -> Iterator[DriverSession]:
    """Hold `cfg`'s work-dir lock (`workflows.lock`: one driver per work dir) and, with
    `start_ray`, reach Ray (`pipeline.ray_env.ensure_ray`) and check that it can run the stages
    `runs` (`workflows.preflight.check_ray`); stop a Ray this call started."""
    started_ray = False
    try:
        with WorkDirLock(cfg.run.work_dir):
            if start_ray:
                started_ray = ensure_ray(cfg)
                check_ray(cfg, runs)
            yield DriverSession(cfg)
    finally:
        if started_ray:
            import ray

            ray.shutdown()
