"""A preemption notice (SIGTERM) becomes a checkpoint at the next step boundary the group agrees on.

Spot/preemptible VMs and Kubernetes announce a termination with SIGTERM, 30 s to 2 min ahead.
Ray's default SIGTERM handler in a worker exits the process at once, so the group restarts
from the latest interval checkpoint. Here a worker that receives SIGTERM records the notice
instead, and the group writes a checkpoint at a step boundary, then stops (`Preempted`): the
run resumes from that step.

How the ranks agree on the step without an extra sync on ordinary steps. After each step every
rank *starts* a non-blocking all-reduce (MIN) of two numbers, [seconds of grace left (+inf
without a notice), -(seconds a step plus a save take)], and waits for the one it started a step
earlier. That earlier one was started by every rank at the same boundary and every rank has
since been through the step's gradient all-reduce, so the wait returns at once: no rank ever
waits on it. All ranks then see the same reduced values at the same step, and decide the same:
a notice seen by any rank during step k is in the reduction started after step k, read after
step k+1, so the checkpoint is at step k+1 (on one worker: at step k). The reduction runs on
CPU tensors in a gloo group of its own (on NCCL a device tensor's `.item()` would sync the
stream every step). It fits when the grace left when it was sent, minus one step and one save
(the last ones measured; before the first checkpoint, the step alone), is positive; else the
group stops without it and the run resumes from the latest interval checkpoint (README, "On
spot or preemptible nodes").

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

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

_notice: dict[str, float] = {}  # {"at": time.monotonic() of the first SIGTERM}
NO_NOTICE = 1e18  # "seconds left" of a rank without a notice (the all-reduce is MIN)


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


def notice_age() -> float | None:
    """Seconds since this process's SIGTERM; None without one."""
    at = _notice.get("at")
    return None if at is None else time.monotonic() - at


def reset() -> None:
    """Forget a notice (tests)."""
    _notice.clear()


class Agreement:
    """Per worker: after each step, `after_step()` says whether the group stops here."""

    def __init__(self, grace_s: float, rank: int, world_size: int):
        self.grace_s, self.rank, self.world = grace_s, rank, world_size
        self.group = None
        if world_size > 1:
            # A gloo group of its own (collective: every rank creates it, at start-up): CPU
            # tensors, so reading the result never syncs a GPU stream, and its operations never
            # interleave with DDP's on the default group.
            self.group = dist.new_group(backend="gloo")
        # In the main thread (the loop run in-process) the handler is installed here and put
        # back by close(); in a Ray Train worker the callback installed it.
        self._replaced = install()
        self.pending: tuple[Any, torch.Tensor] | None = None
        self.step_s, self.save_s = 0.0, 0.0
        self.seen_step: int | None = None

    def observe(self, step_s: float | None = None, save_s: float | None = None) -> None:
        """The latest step's and checkpoint's durations (what a preemption checkpoint costs)."""
        if step_s is not None:
            self.step_s = step_s
        if save_s is not None:
            self.save_s = save_s

    def _local(self) -> list[float]:
        age = notice_age()
        left = NO_NOTICE if age is None else self.grace_s - age
        return [left, -(self.step_s + self.save_s)]

    def after_step(self, step: int) -> tuple[bool, bool]:
        """(stop now, with a checkpoint): the same answer on every rank at the same step."""
        local = self._local()
        if local[0] < NO_NOTICE and self.seen_step is None:
            self.seen_step = step
            log.warning("preemption: rank %d got SIGTERM during step %d; the group checkpoints at the next "
                        "agreed step boundary if it fits in workers.preemption_grace_s=%g s", self.rank, step,
                        self.grace_s)
        if self.world == 1:
            agreed = local
            left_after = agreed[0] - self.save_s  # this step is done already
        else:
            agreed = self._exchange(local)
            if agreed is None:
                return False, False
            left_after = agreed[0] + agreed[1]  # a step (done since it was sent) and a save
        if agreed[0] >= NO_NOTICE:
            return False, False
        fits = left_after > 0
        if self.rank == 0:
            log.warning("preemption: the group stops at step %d %s (%.1f s of grace left when agreed; a step "
                        "+ a save take %.1f s)", step, "after a checkpoint" if fits else
                        "WITHOUT a checkpoint: it does not fit", agreed[0], -agreed[1])
        return True, fits

    def _exchange(self, local: list[float]) -> list[float] | None:
        """Start this boundary's reduction; the previous boundary's result (None at the first)."""
        previous = None
        if self.pending is not None:
            work, t = self.pending
            work.wait()
            previous = t.tolist()
        t = torch.tensor(local, dtype=torch.float64)
        work = dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group, async_op=True)
        self.pending = (work, t)
        return previous

    def close(self) -> None:
        """Wait for the reduction in flight (every rank started it), so none is left dangling;
        put back the SIGTERM handler this object replaced."""
        if self.pending is not None:
            self.pending[0].wait()
            self.pending = None
        if self._replaced is not None:
            signal.signal(signal.SIGTERM, self._replaced)
            self._replaced = None


def stop_if_noticed(notice: Agreement, step_s: float, step: int, checkpoint: Any, session: Any) -> None:
    """The loop's hook after each step: at the step the group agrees on after a SIGTERM to any
    worker, `checkpoint()` (synchronous) when it fits, then `Preempted`."""
    notice.observe(step_s=step_s)
    stop, fits = notice.after_step(step)
    if not stop:
        return
    if fits:
        checkpoint()
        flush = getattr(session, "flush_reports", None)  # Ray: registered before the group stops
        if flush is not None:
            flush(timeout_s=10.0)
    raise Preempted(f"preemption notice (SIGTERM): stopped at step {step} "
                    f"{'after a checkpoint' if fits else 'without a checkpoint'}")


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
