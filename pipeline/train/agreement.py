"""What the workers must share after a step, in one collective at one place in the loop.

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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

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
