"""Early stopping (`train.early_stop_patience`, `train.early_stop_metric`): stop when the dev
metric has not improved for N validations in a row.

As fairseq's ``--patience`` (checkpoint_utils.should_stop_early) and Marian's
``--early-stopping``: a validation improves when it beats the best so far strictly (BLEU higher,
loss lower); the count of validations without improvement restarts at every new best, and the
run stops when it reaches the patience. Off (0) by default: the paper trains a fixed number of
steps (§5.3).

Where the values come from:
- "val_loss": the loop's own dev loss every ``metrics.val_loss_interval_steps`` (rank 0's
  `Progress.history_val`, kept in every checkpoint);
- "dev_bleu": each checkpoint's dev sacreBLEU, computed by Ray Train's asynchronous validation
  task (pipeline/train/dev_bleu_task.py) and read back from its per-checkpoint records, which rank 0
  polls on log steps. A value is seen only when its task has finished, so the stop comes some
  steps after the checkpoint that decided it; checkpoints skipped by the backlog are no validations.

Resume: the count is rebuilt from what was logged up to the restored checkpoint (its
`history_val`, or the dev BLEU records of steps up to it), so a crash neither resets nor
double-counts it. The decision is rank 0's, broadcast, so every worker stops at the same step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

from pipeline.config import ConfigError, TrainConfig
from pipeline.train.checkpoint import Cadence, Progress

log = logging.getLogger(__name__)

HIGHER_IS_BETTER = {"dev_bleu": True, "val_loss": False}


@dataclass
class EarlyStop:
    """The rule over one run's validations: the count since the best value; `observe` says when to
    stop (`EarlyStopDecision` applies it in the loop)."""

    patience: int  # > 0
    metric: str  # "dev_bleu" | "val_loss"
    best: float | None = None
    best_step: int = -1
    num_bad: int = 0  # validations since the best one
    last_step: int = -1  # the step of the last value observed (a value is observed once)

    def observe(self, step: int, value: float) -> bool:
        """Take the validation of `step`; True when the run should stop now."""
        if step <= self.last_step:
            return False
        self.last_step = step
        if self.best is None or (value > self.best if HIGHER_IS_BETTER[self.metric] else value < self.best):
            self.best, self.best_step, self.num_bad = value, step, 0
        else:
            self.num_bad += 1
        return self.num_bad >= self.patience

    def replay(self, values: Iterable[tuple[int, float]], up_to: int) -> bool:
        """Observe the logged `(step, value)`s up to step `up_to` (a resume); True if they already stop."""
        stop = False
        for step, value in sorted(values):
            if step <= up_to:
                stop = self.observe(step, value) or stop
        return stop

    def record(self, step: int, max_steps: int) -> dict[str, Any]:
        """What the run keeps (checkpoint, outputs, report) when it stops at `step`."""
        return {"step": step, "max_steps": max_steps, "metric": self.metric, "patience": self.patience,
                "best": self.best, "best_step": self.best_step, "num_bad": self.num_bad}

    def describe(self) -> str:
        return (f"{self.metric} has not improved for {self.num_bad} validation(s) (patience {self.patience}); "
                f"best {self.best:.4f} at step {self.best_step}")


def val_loss_values(history_val: list[list[float]]) -> list[tuple[int, float]]:
    """(step, val loss) from `Progress.history_val` ([step, loss, nll] rows)."""
    return [(int(row[0]), float(row[1])) for row in history_val]


class DevBleuRecords:
    """The validated dev BLEU records of a Ray Train run dir, read as they appear (each file once)."""

    def __init__(self, run_dir: str):
        self.run_dir = run_dir
        self.seen: set[str] = set()

    def new_values(self, up_to: int) -> list[tuple[int, float]]:
        """(step, dev sacreBLEU) of the records of steps <= `up_to` not returned before (a record
        of a later step, possible only for a checkpoint this attempt has not reached, waits)."""
        from pipeline.decoding.dev_bleu_records import read_record, record_names

        out = []
        for rel in record_names(self.run_dir):
            if rel in self.seen:
                continue
            try:
                record = read_record(self.run_dir, rel)
            except (OSError, ValueError):
                continue  # being written: read it next time
            if int(record.get("step", 0)) > up_to:
                continue
            self.seen.add(rel)
            if record.get("status") == "validated":
                out.append((int(record["step"]), float(record["bleu_sacre"])))
        return sorted(out)


def agree(stop: bool, device: torch.device, world: int) -> bool:
    """Rank 0's decision on every rank (a broadcast: every rank calls it at the same step)."""
    if world == 1:
        return stop
    flag = torch.tensor([int(stop)], device=device)
    dist.broadcast(flag, src=0)
    return bool(flag.item())


class EarlyStopDecision:
    """The training loop's early-stop decision (`pipeline.train.loop.Trainer`): the `EarlyStop` rule
    over its metric's values, rebuilt at a resume (`resume`), and the decision at a step (`decide`):
    rank 0's, agreed by all."""

    def __init__(self, tc: TrainConfig, dev_bleu_dir: str, rank: int, world: int, device: torch.device):
        self.tc, self.rank, self.world, self.device = tc, rank, world, device
        self.early = EarlyStop(tc.early_stop_patience, tc.early_stop_metric)
        self.dev_bleu = DevBleuRecords(dev_bleu_dir) if tc.early_stop_metric == "dev_bleu" else None
        self._stop_pending = False  # the resumed count already said stop (decided at the next step)

    @classmethod
    def for_loop(cls, tc: TrainConfig, validates: bool, dev_bleu_dir: str, rank: int, world: int,
                 device: torch.device) -> "EarlyStopDecision | None":
        """None when early stopping is off; a ConfigError when its metric has no values."""
        if not tc.early_stop_patience:
            return None
        if tc.early_stop_metric == "val_loss" and not validates:
            raise ConfigError("train.early_stop_metric = 'val_loss' needs a dev split (the encode stage has none)")
        if tc.early_stop_metric == "dev_bleu" and not dev_bleu_dir:
            raise ConfigError("train.early_stop_metric = 'dev_bleu' needs dev BLEU per checkpoint "
                              "(eval.dev_bleu and a dev split); or use 'val_loss'")
        return cls(tc, dev_bleu_dir, rank, world, device)

    def resume(self, p: Progress) -> None:
        """After restoring the checkpoint `p`: continue the count from what was logged up to it."""
        e = self.early
        if self.rank != 0:
            return
        logged = val_loss_values(p.history_val) if e.metric == "val_loss" else self.dev_bleu.new_values(p.step)
        self._stop_pending = e.replay(logged, p.step) and not p.early_stop
        if e.best is not None:
            log.info("early stopping: %d of %d validation(s) without improvement of %s at the resume "
                     "(best %.4f at step %d)", e.num_bad, e.patience, e.metric, e.best, e.best_step)

    def decide(self, p: Progress, cadence: Cadence, log_metrics: Callable[[dict[str, float]], None]) -> bool:
        """Early stopping's decision at this step (rank 0's, agreed by all): on validation steps
        for val_loss, on log steps for dev BLEU (its records arrive asynchronously). A stop is
        recorded in `p.early_stop` and logged through `log_metrics`."""
        e = self.early
        if not (cadence.validates_at(p.step) if e.metric == "val_loss" else cadence.logs(p.step)):
            return False
        stop = False
        if self.rank == 0:
            values = val_loss_values(p.history_val[-1:]) if e.metric == "val_loss" else self.dev_bleu.new_values(p.step)
            for step, value in values:
                stop = e.observe(step, value) or stop
            stop, self._stop_pending = stop or self._stop_pending, False
        if not agree(stop, self.device, self.world):
            return False
        p.early_stop = e.record(p.step, self.tc.max_steps)
        if self.rank == 0:
            log.warning("early stop at step %d of %d: %s", p.step, self.tc.max_steps, e.describe())
            log_metrics({"train/early_stop_step": float(p.step), "train/early_stop_best": float(e.best),
                         "train/early_stop_best_step": float(e.best_step)})
        return True
