"""What the workers share after a step, in one collective at one place in the loop, and what it decides.

After every step each rank brings a `Local` and gets back the same `Agreed` as every other rank:
- on a log step, the window's loss and nll sums (added over the ranks);
- on a validation step, the dev loss, nll and target-token sums (added);
- rank 0's wishes: a time-based checkpoint (`checkpoint.interval_s`: wall clocks differ between
  workers, so rank 0's decides) and early stopping on dev BLEU (only rank 0 reads its records);
- the preemption notice: the grace left (the least over the ranks), what a step and a save take
  (the most).

On a step that logs or validates (every rank knows which steps do) the exchange is blocking: the
sums leave the device then anyway, and the wishes are only made on those steps. On any other step
only the notice travels, and the exchange is started without waiting: its result is read after
the next step. By then every rank has been through that step's gradient all-reduce, so the wait
returns at once, and an ordinary step never waits for the device or for the other workers. All
ranks read the same values at the same step, so all decide alike (`pipeline.train.preemption`).

The collective is an `all_gather` of a few float64 numbers per rank, on CPU tensors in a gloo
group of its own: reading it never syncs a GPU stream, and it never interleaves with DDP's
all-reduces on the default group. In one process there is nothing to exchange.

What the loop then does is decided here too, by `decide`: a pure function of the agreed row, the
step, the interval rules (`Cadence`) and the early-stop verdict. It returns the `Action`s the loop
carries out, in this order:

    LOG                  the agreement holds the window's loss sums (a log step)
    DEV_LOSS             the agreement holds the dev sums (a validation step)
    EARLY_STOP           the early-stop rule says stop (its verdict, kept by
                         `pipeline.train.early_stop.EarlyStopDecision`, is an input)
    STOP_PREEMPTED_AFTER_CHECKPOINT / STOP_PREEMPTED
                         a preemption notice reached the agreement (`pipeline.train.preemption`):
                         a synchronous checkpoint if it fits (`verdict`), then the group stops;
                         nothing follows
    CHECKPOINT           an early stop, `checkpoint.interval_steps` (or the last step), or rank 0's
                         time-based wish (`checkpoint.interval_s`, in the agreement)

Every rank reads the same agreement at the same step, so every rank gets the same list.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable

import torch
import torch.distributed as dist

from pipeline.config import CheckpointSection, MetricsSection

NO_NOTICE = 1e18  # the grace left of a rank without a preemption notice (the ranks take the least)


@dataclass(kw_only=True)
class Local:
    """One rank's side of a step's agreement."""

    log_sums: torch.Tensor | None = None  # (2,) the window's loss and nll sums, on a log step
    dev_sums: torch.Tensor | None = None  # (3,) dev loss, nll and target tokens, on a validation step
    checkpoint_due: bool = False  # rank 0's: checkpoint.interval_s has passed since the last one
    stop: bool = False  # rank 0's: early stopping on dev BLEU says stop
    grace_left_s: float = NO_NOTICE  # seconds of a preemption notice's grace left
    step_and_save_s: float = 0.0  # the last step plus the last checkpoint save, in seconds
    save_s: float = 0.0  # the last checkpoint save, in seconds


@dataclass(kw_only=True)
class Agreed:
    """What every rank reads after a step: the same numbers on all of them."""

    log_sums: list[float] | None
    dev_sums: list[float] | None
    checkpoint_due: bool
    stop: bool
    grace_left_s: float
    step_and_save_s: float
    save_s: float
    lagged: bool  # the notice's values were sent one step ago (a step has run since)


def _rank0(values: list[float]) -> float:
    return values[0]


# The exchanged row, field by field: (the field of `Local` and `Agreed`, its width, how the ranks'
# values of each of its numbers become the agreed one).
ROW: tuple[tuple[str, int, Callable[[list[float]], float]], ...] = (
    ("log_sums", 2, sum),  # added over the ranks
    ("dev_sums", 3, sum),  # added over the ranks
    ("checkpoint_due", 1, _rank0),  # rank 0's wish
    ("stop", 1, _rank0),  # rank 0's wish
    ("grace_left_s", 1, min),  # the least grace left over the ranks
    ("step_and_save_s", 1, max),  # the slowest rank's
    ("save_s", 1, max),  # the slowest rank's
)
_WIDTH = sum(width for _, width, _ in ROW)


def _flat(local: Local) -> list[float]:
    """The rank's row: each field of `ROW` as its `width` numbers (an absent sum as zeros)."""
    out: list[float] = []
    for name, width, _ in ROW:
        value = getattr(local, name)
        if value is None:
            out += [0.0] * width
        elif isinstance(value, torch.Tensor):
            out += value.to(torch.float64).tolist()
        else:
            out.append(float(value))
    return out


def _combine(rows: list[list[float]], has_log: bool, has_dev: bool, lagged: bool) -> Agreed:
    """The ranks' rows (rank order) as one `Agreed`, each number reduced as `ROW` says."""
    agreed: dict[str, Any] = {}
    start = 0
    for name, width, reduce in ROW:
        values = [reduce([row[i] for row in rows]) for i in range(start, start + width)]
        agreed[name] = values if width > 1 else values[0]
        start += width
    return Agreed(**{**agreed, "log_sums": agreed["log_sums"] if has_log else None,
                     "dev_sums": agreed["dev_sums"] if has_dev else None,
                     "checkpoint_due": bool(agreed["checkpoint_due"]), "stop": bool(agreed["stop"])}, lagged=lagged)


class StepAgreement:
    """One worker's side of the per-step exchange; `exchange` once after every step, `close` at the end."""

    def __init__(self, world_size: int):
        self.world = world_size
        # Collective at start-up (every rank creates it): CPU tensors, apart from DDP's group.
        self.group = dist.new_group(backend="gloo") if world_size > 1 else None
        self.pending: tuple[Any, list[torch.Tensor]] | None = None

    def exchange(self, local: Local, blocking: bool) -> Agreed | None:
        """This step's agreement (`blocking`), or the previous step's notice values (None after the
        first step): every rank must call it after every step with the same `blocking`."""
        has_log, has_dev = local.log_sums is not None, local.dev_sums is not None
        if self.world == 1:
            return _combine([_flat(local)], has_log, has_dev, lagged=False)
        previous = self._finish_pending()
        rows = [torch.empty(_WIDTH, dtype=torch.float64) for _ in range(self.world)]
        mine = torch.tensor(_flat(local), dtype=torch.float64)
        if blocking:
            dist.all_gather(rows, mine, group=self.group)
            return _combine([r.tolist() for r in rows], has_log, has_dev, lagged=False)
        self.pending = (dist.all_gather(rows, mine, group=self.group, async_op=True), rows)
        return previous

    def _finish_pending(self) -> Agreed | None:
        if self.pending is None:
            return None
        work, rows = self.pending
        self.pending = None
        work.wait()
        return _combine([r.tolist() for r in rows], False, False, lagged=True)

    def close(self) -> None:
        """Wait for the exchange in flight (every rank started it), so none is left dangling."""
        self._finish_pending()


def verdict(agreed: Agreed | None) -> tuple[bool, bool]:
    """A preemption notice's (stop now, with a checkpoint) from the step's agreement (or None): the
    same answer on every rank at the same step (`pipeline.train.preemption`)."""
    if agreed is None or agreed.grace_left_s >= NO_NOTICE:
        return False, False
    # Sent a step ago: that step and a save still have to fit; sent now: the save alone.
    left_after = agreed.grace_left_s - (agreed.step_and_save_s if agreed.lagged else agreed.save_s)
    return True, left_after > 0


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
# rank 0's clock decides, and its wish travels in the step's agreement (`Local.checkpoint_due`).
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
    # Without a notice on any rank every rank sends no grace (NO_NOTICE): no stop.
    stop, fits = verdict(agreed)
    if stop:  # the stop ends the loop: no other checkpoint follows
        return actions + [Action.STOP_PREEMPTED_AFTER_CHECKPOINT if fits else Action.STOP_PREEMPTED]
    if early_stop or cadence.interval_due(step) or (agreed is not None and agreed.checkpoint_due):
        actions.append(Action.CHECKPOINT)
    return actions
