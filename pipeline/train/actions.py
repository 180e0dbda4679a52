"""What the loop does after a step, decided in one place from the step's agreement.

`decide` is a pure function of the agreed row (`pipeline.train.agreement.Agreed`), the step, the
interval rules (`Cadence`, below) and the early-stop verdict; it returns the
`Action`s the loop then carries out in this order:

    LOG                  the agreement holds the window's loss sums (a log step)
    DEV_LOSS             the agreement holds the dev sums (a validation step)
    EARLY_STOP           the early-stop rule says stop (its verdict, kept by
                         `pipeline.train.early_stop.EarlyStopDecision`, is an input)
    STOP_PREEMPTED_AFTER_CHECKPOINT / STOP_PREEMPTED
                         a preemption notice reached the agreement (`pipeline.train.preemption`):
                         a synchronous checkpoint if it fits, then the group stops; nothing follows
    CHECKPOINT           an early stop, `checkpoint.interval_steps` (or the last step), or rank 0's
                         time-based wish (`checkpoint.interval_s`, in the agreement)

Every rank reads the same agreement at the same step, so every rank gets the same list.
"""

from __future__ import annotations

import time
from enum import Enum

from pipeline.config import CheckpointSection, MetricsSection
from pipeline.train import preemption
from pipeline.train.agreement import Agreed


class Action(Enum):
    LOG = "log"  # the log line of the window's steps; a new window
    DEV_LOSS = "dev_loss"  # the dev loss logged and kept in the history
    EARLY_STOP = "early_stop"  # the stop recorded in the progress and logged
    STOP_PREEMPTED_AFTER_CHECKPOINT = "stop_preempted_after_checkpoint"  # a synchronous checkpoint, then stop
    STOP_PREEMPTED = "stop_preempted"  # stop without a checkpoint: it does not fit in the grace left
    CHECKPOINT = "checkpoint"


# When a step logs, validates or checkpoints (`train.*_interval_*`): one place for the rules.
# Every worker reaches the same decision at the same step without talking, except for the
# time-based checkpoint (`checkpoint.interval_s`): wall clocks differ between workers, so
# rank 0's clock decides, and its wish travels in the step's agreement (`pipeline.train.agreement`).
# It is asked on log steps only (whose agreement every rank waits for anyway), so a time-based
# checkpoint comes at most `metrics.log_interval_steps` late.
class Cadence:
    """The interval rules of one worker; `checkpointed()` restarts the checkpoint clock."""

    def __init__(self, max_steps: int, metrics: MetricsSection, checkpoint: CheckpointSection, validates: bool):
        self.max_steps, self.metrics, self.checkpoint, self.validates = max_steps, metrics, checkpoint, validates
        self.last_checkpoint_t = time.monotonic()

    def _every(self, step: int, interval: int) -> bool:
        return step % interval == 0 or step == self.max_steps

    def logs(self, step: int) -> bool:
        return self._every(step, self.metrics.log_interval_steps)

    def validates_at(self, step: int) -> bool:
        return self.validates and self._every(step, self.metrics.val_loss_interval_steps)

    def syncs(self, step: int) -> bool:
        """Whether the ranks wait for this step's agreement: it logs or validates."""
        return self.logs(step) or self.validates_at(step)

    def interval_due(self, step: int) -> bool:
        """A checkpoint by `checkpoint.interval_steps` (or the last step)."""
        return self._every(step, self.checkpoint.interval_steps)

    def time_due(self, step: int) -> bool:
        """This worker's clock says a checkpoint by `checkpoint.interval_s` (asked on log steps)."""
        return (self.checkpoint.interval_s > 0 and self.logs(step)
                and time.monotonic() - self.last_checkpoint_t >= self.checkpoint.interval_s)

    def checkpointed(self) -> None:
        self.last_checkpoint_t = time.monotonic()


def decide(agreed: Agreed | None, step: int, cadence: Cadence, early_stop: bool) -> list[Action]:
    """The actions after `step`, in order. `agreed`: the step's agreement (None: an ordinary step
    before any agreement was read); `early_stop`: the early-stop rule's verdict at this step."""
    actions = []
    if agreed is not None and agreed.log_sums is not None:
        actions.append(Action.LOG)
    if agreed is not None and agreed.dev_sums is not None:
        actions.append(Action.DEV_LOSS)
    if early_stop:
        actions.append(Action.EARLY_STOP)
    # Without a notice on any rank every rank sends no grace (agreement.NO_NOTICE): no stop.
    stop, fits = preemption.verdict(agreed)
    if stop:  # the stop ends the loop: no other checkpoint follows
        return actions + [Action.STOP_PREEMPTED_AFTER_CHECKPOINT if fits else Action.STOP_PREEMPTED]
    if early_stop or cadence.interval_due(step) or (agreed is not None and agreed.checkpoint_due):
        actions.append(Action.CHECKPOINT)
    return actions
