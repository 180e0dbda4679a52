"""A preemption notice (SIGTERM) becomes a checkpoint at the next step boundary the group agrees on.

Spot/preemptible VMs and Kubernetes announce a termination with SIGTERM, 30 s to 2 min ahead.
Ray's default SIGTERM handler in a worker exits the process at once, so the group restarts
from the latest interval checkpoint. Here a worker that receives SIGTERM records the notice
instead, and the group writes a checkpoint at a step boundary, then stops (`Preempted`): the
run resumes from that step.

How the ranks agree on the step without an extra sync on ordinary steps: each rank's notice
(the grace left, what a step and a save take) travels in the step's agreement
(`pipeline.train.agreement`), which on an ordinary step is read one step later. A notice seen by
any rank during step k is then read after step k+1 by every rank, so the checkpoint is at step k+1
(on one worker, or when step k logs or validates: at step k). It fits when the grace left when it
was sent, less what still has to run (a step, if one ran since, and a save; before the first
checkpoint, the step alone), is positive (`pipeline.train.agreement.verdict`); else the group stops
without it and the run resumes from the latest interval checkpoint (docs/recovery.md).

The handler is installed in the process's main thread (a Python rule): by `RaySession` through
a Ray Train worker callback (the training loop runs in a thread of the worker actor), or by
`install()` when the loop runs in the main thread (tests, benchmarks).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from typing import Any

log = logging.getLogger(__name__)

_notice: dict[str, float] = {}  # {"at": time.monotonic() of the first SIGTERM}


class Preempted(RuntimeError):
    """The group stopped for a preemption notice (after its checkpoint, if one fitted)."""


def _on_sigterm(signum: int, frame: Any) -> None:
    if "at" not in _notice:
        _notice["at"] = time.monotonic()
        # No logging here: a signal handler may interrupt a logging call holding its lock.


def install() -> Any:
    """Make SIGTERM a notice in this process (main thread only): the handler it replaced, or
    None when it cannot (another thread)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, _on_sigterm)


def reset() -> None:
    """Forget a notice (tests)."""
    _notice.clear()


class Notice:
    """This worker's side of a preemption: the SIGTERM handler (installed while the loop runs in the
    main thread), what a checkpoint costs (`save_s`, the latest save's seconds, which the loop
    records), and the grace left once a SIGTERM came (`received` is then true)."""

    def __init__(self, grace_s: float, rank: int):
        self.grace_s, self.rank = grace_s, rank
        # In the main thread (the loop run in-process) the handler is installed here and put
        # back by close(); in a Ray Train worker the callback installed it.
        self._replaced = install()
        self.received = _notice  # the handler's record: empty until this process's first SIGTERM
        self.save_s = 0.0
        self.seen_step: int | None = None

    def grace_left(self, step: int) -> float:
        """Seconds of grace left for the agreement after `step`, once `received` (the first call logs it)."""
        if self.seen_step is None:
            self.seen_step = step
            log.warning("preemption: rank %d got SIGTERM during step %d; the group checkpoints at the next "
                        "agreed step boundary if it fits in workers.preemption_grace_s=%g s", self.rank, step,
                        self.grace_s)
        return self.grace_s - (time.monotonic() - self.received["at"])

    def close(self) -> None:
        """Put back the SIGTERM handler this object replaced."""
        if self._replaced is not None:
            signal.signal(signal.SIGTERM, self._replaced)
            self._replaced = None


def announce(agreed: Any, step: int, fits: bool) -> None:
    """The warning of a stop at `step` (rank 0 logs it)."""
    log.warning("preemption: the group stops at step %d %s (%.1f s of grace left when agreed; a step "
                "+ a save take %.1f s)", step, "after a checkpoint" if fits else
                "WITHOUT a checkpoint: it does not fit", agreed.grace_left_s, agreed.step_and_save_s)


def ray_worker_callback() -> Any:
    """A Ray Train `WorkerCallback` that installs the handler in each worker actor's main thread
    (its `after_init_train_context` runs there, before the training thread starts)."""
    from ray.train.v2._internal.execution.callback import WorkerCallback

    class SigtermToCheckpoint(WorkerCallback):
        def after_init_train_context(self) -> None:
            reset()
            if not install():
                log.warning("preemption: could not install the SIGTERM handler (not the main thread)")

    return SigtermToCheckpoint()
