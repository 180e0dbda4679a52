"""Early stopping (`train.early_stop_patience`, `train.early_stop_metric`): stop when the dev
metric has not improved for N validations in a row.

As fairseq's ``--patience`` (checkpoint_utils.should_stop_early) and Marian's
``--early-stopping``: a validation improves when it beats the best so far strictly (BLEU higher,
loss lower); the count of validations without improvement restarts at every new best, and the
run stops when it reaches the patience. Off (0) by default: the paper trains a fixed number of
steps (§5.2).

Where the values come from:
- "val_loss": the loop's own dev loss every ``metrics.val_loss_interval_steps`` (rank 0's
  `Progress.history_val`, kept in every checkpoint);
- "dev_bleu": each checkpoint's dev sacreBLEU, computed by Ray Train's asynchronous validation
  task (pipeline/train/dev_bleu_task.py) and read back from its per-checkpoint records, which rank 0
  polls on log steps. A value is seen only when its task has finished, so the stop comes some
  steps after the checkpoint that decided it; checkpoints skipped by the backlog are no validations.

Resume: the count is rebuilt from what was logged up to the restored checkpoint (its
`history_val`, or the dev BLEU records of steps up to it), so a crash neither resets nor
double-counts it. Every worker stops at the same step: each keeps the val-loss count over the dev
losses the step's agreement gives them all (`pipeline.train.agreement`), and rank 0's dev BLEU
wish travels in that agreement.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Iterable


from pipeline.config import ConfigError, TrainSection
from pipeline.train.checkpoint import Progress

log = logging.getLogger(__name__)

HIGHER_IS_BETTER = {"dev_bleu": True, "val_loss": False}


@dataclass(kw_only=True)
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


class EarlyStopDecision:
    """The training loop's early-stop decision (`pipeline.train.loop.Trainer`): the `EarlyStop` rule
    over its metric's values, rebuilt at a resume (`resume`); rank 0's dev BLEU wish before a step's
    agreement (`wish`), and the decision after it (`decide`), the same on every rank; `announce`
    and `metrics` when the loop records the stop."""

    def __init__(self, tc: TrainSection, dev_bleu_dir: str, rank: int):
        self.tc, self.rank = tc, rank
        self.early = EarlyStop(patience=tc.early_stop_patience, metric=tc.early_stop_metric)
        self.dev_bleu = DevBleuRecords(dev_bleu_dir) if tc.early_stop_metric == "dev_bleu" else None
        self._stop_pending = False  # the resumed count already said stop (decided at the next step)

    @classmethod
    def for_loop(cls, tc: TrainSection, validates: bool, dev_bleu_dir: str, rank: int) -> "EarlyStopDecision | None":
        """None when early stopping is off; a ConfigError when its metric has no values."""
        if not tc.early_stop_patience:
            return None
        if tc.early_stop_metric == "val_loss" and not validates:
            raise ConfigError("train.early_stop_metric = 'val_loss' needs a dev split (the encode stage has none)")
        if tc.early_stop_metric == "dev_bleu" and not dev_bleu_dir:
            raise ConfigError("train.early_stop_metric = 'dev_bleu' needs dev BLEU per checkpoint "
                              "(dev_bleu.enabled and a dev split); or use 'val_loss'")
        return cls(tc, dev_bleu_dir, rank)

    def resume(self, p: Progress) -> None:
        """After restoring the checkpoint `p`: continue the count from what was logged up to it (the
        dev losses on every rank, the dev BLEU records on rank 0)."""
        e = self.early
        if self.dev_bleu is not None and self.rank != 0:
            return
        logged = val_loss_values(p.history_val) if self.dev_bleu is None else self.dev_bleu.new_values(p.step)
        self._stop_pending = e.replay(logged, p.step) and not p.early_stop
        if e.best is not None and self.rank == 0:
            log.info("early stopping: %d of %d validation(s) without improvement of %s at the resume "
                     "(best %.4f at step %d)", e.num_bad, e.patience, e.metric, e.best, e.best_step)

    def wish(self, step: int, logs: bool) -> bool:
        """Rank 0, before a log step's agreement: whether the dev BLEU records that have arrived say
        stop. False for the val-loss rule (decided on every rank after the agreement)."""
        if self.dev_bleu is None or not logs or self.rank != 0:
            return False
        stop = False
        for s, value in self.dev_bleu.new_values(step):
            stop = self.early.observe(s, value) or stop
        stop, self._stop_pending = stop or self._stop_pending, False
        return stop

    def decide(self, step: int, agreed_wish: bool, val_loss: float | None) -> dict[str, Any] | None:
        """After the step's agreement: the stop's record when the run stops at `step`, else None.
        val_loss: the agreed dev loss of a validation step (None elsewhere)."""
        e = self.early
        if self.dev_bleu is not None:
            stop = agreed_wish
        elif val_loss is None:
            return None
        else:
            stop = e.observe(step, val_loss)
            stop, self._stop_pending = stop or self._stop_pending, False
        return e.record(step, self.tc.max_steps) if stop else None

    def announce(self, step: int) -> None:
        """The warning of a stop at `step` (rank 0 logs it, when the loop records the stop)."""
        log.warning("early stop at step %d of %d: %s", step, self.tc.max_steps, self.early.describe())

    def metrics(self, step: int) -> dict[str, float]:
        """What a stop logs."""
        return {"train/early_stop_step": float(step), "train/early_stop_best": float(self.early.best),
                "train/early_stop_best_step": float(self.early.best_step)}
