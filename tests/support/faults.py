"""Fault injection for the train tests: a session wrapper, installed from outside the product.

The train stage copies `TRANSFORMER_REPRO_SESSION_WRAPPER` from the driver's environment into
every worker's `LoopSpec`, and each worker wraps its session with it (`pipeline.train.session.wrap`).
`env(step, marker, mode)` is the value that installs `inject` here:

    raise   the last worker raises before step `step` (a worker failure for Ray Train to recover from)
    hang    the last worker stops before step `step` (so a test can kill the driver at a known step)
    upload  rank 0's process dies while the first checkpoint at or after `step` is being uploaded,
            after copying one file of three to the destination (a node lost mid-upload)

Each fault happens once: it writes `marker` (the step) first, and does nothing while it exists.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from pipeline.train import checkpoint as train_checkpoint
from pipeline.train.session import SESSION_WRAPPER_ENV

log = logging.getLogger(__name__)

MODES = ("raise", "hang", "upload")


def env(step: int, marker: str | Path, mode: str = "raise") -> dict[str, str]:
    """The driver environment that injects this fault into every worker."""
    assert mode in MODES, mode
    return {SESSION_WRAPPER_ENV: f"{__name__}:inject:{step}:{marker}:{mode}"}


def inject(session: Any, argument: str) -> "FaultySession":
    step, marker, mode = argument.split(":")
    return FaultySession(session, int(step), marker, mode)


class FaultySession:
    """`session` with one fault; everything else passes through."""

    def __init__(self, inner: Any, step: int, marker: str, mode: str):
        self.inner, self.step, self.marker, self.mode = inner, step, Path(marker), mode
        self.rank, self.world_size, self.device = inner.rank, inner.world_size, inner.device

    def latest_checkpoint(self) -> Any:
        return self.inner.latest_checkpoint()

    def _fire(self, step: int) -> bool:
        if self.marker.exists():
            return False
        self.marker.write_text(str(step))
        return True

    def before_step(self, step: int) -> None:
        if self.inner.before_step is not None:
            self.inner.before_step(step)
        if self.mode == "upload" or step != self.step or self.rank != self.world_size - 1 or not self._fire(step):
            return
        if self.mode == "hang":
            log.warning("fault injection: worker %d hangs before step %d", self.rank, step)
            while True:
                time.sleep(60)
        raise RuntimeError(f"injected failure before step {step} (tests/support/faults.py)")

    def report(self, metrics: dict[str, Any], checkpoint_dir: str | None, dir_name: str | None,
               upload_async: bool = False) -> None:
        dying = (self.mode == "upload" and checkpoint_dir is not None and metrics.get("step", 0) >= self.step
                 and self._fire(metrics["step"]))
        if not dying:
            return self.inner.report(metrics, checkpoint_dir, dir_name, upload_async)
        return self.inner.report(metrics, checkpoint_dir, dir_name, upload_async, upload_fn=_dying_upload)


def _dying_upload(checkpoint: Any, dir_name: str) -> Any:
    """Copy one file of the checkpoint to its destination, then kill this worker process, as a
    node lost mid-upload would. Ray Train must never take that folder as a checkpoint."""
    import pyarrow.fs as pafs
    import ray.train

    st = ray.train.get_context().get_storage()
    dest = f"{st.experiment_fs_path}/{dir_name}"
    st.storage_filesystem.create_dir(dest)
    pafs.copy_files(f"{checkpoint.path}/{train_checkpoint.MODEL_FILE}", f"{dest}/{train_checkpoint.MODEL_FILE}",
                    source_filesystem=checkpoint.filesystem, destination_filesystem=st.storage_filesystem)
    # An upload in progress for a while: Ray Train's controller registers each reported checkpoint
    # at its next poll of the workers (every 2 s at most: workers.controller_poll_s; 0.5 s in the suite), so the
    # previous one is registered by the time this worker dies.
    time.sleep(5)
    log.warning("fault injection: worker dies during the upload of %s", dir_name)
    os._exit(1)


def gate_env(path: str | Path) -> dict[str, str]:
    """The driver environment that installs `gate` around every worker's session."""
    return {SESSION_WRAPPER_ENV: f"{__name__}:gate:{path}"}


def set_gate(path: str | Path, step: int) -> None:
    """Let the gated workers run up to `step` (written whole: a worker never reads half a number)."""
    path = Path(path)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(str(step))
    os.replace(tmp, path)


def gate(session: Any, argument: str) -> "GatedSession":
    return GatedSession(session, Path(argument))


GATE_TIMEOUT_S = 600.0  # a test moves the gate within its own (pytest-timeout) bound


class GatedSession:
    """`session` whose workers wait before any step past the number in the file `path` (a test moves
    it on): a test can hold a run at a known step while it changes the cluster, instead of racing
    the loop with sleeps. Waiting changes no number the loop computes."""

    def __init__(self, inner: Any, path: Path):
        self.inner, self.path = inner, path
        self.rank, self.world_size, self.device = inner.rank, inner.world_size, inner.device

    def __getattr__(self, name: str) -> Any:  # latest_checkpoint, report, flush_reports: the inner session's
        return getattr(self.inner, name)

    def before_step(self, step: int) -> None:
        if self.inner.before_step is not None:
            self.inner.before_step(step)
        deadline = time.monotonic() + GATE_TIMEOUT_S
        while step > int(self.path.read_text() or 0):
            if time.monotonic() > deadline:
                raise RuntimeError(f"gate: waited {GATE_TIMEOUT_S:g} s for the test to allow step {step} "
                                   f"(it writes the last allowed step into {self.path})")
            time.sleep(0.05)


def fast_cluster_view() -> None:
    """A Ray `worker_process_setup_hook` (the elastic test's driver sets it): Ray Train's elastic
    policy reads the cluster's nodes from Ray Data's AutoscalingCoordinator actor, which refreshes
    its view every 20 s (a class constant, no setting), so a lost node still counts, and a new one
    does not, for up to 20 s. 2 s here; what the policy then decides is unchanged."""
    from ray.data._internal.cluster_autoscaler import default_autoscaling_coordinator as coordinator

    coordinator._AutoscalingCoordinatorActor.TICK_INTERVAL_S = 2
