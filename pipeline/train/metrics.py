"""Training metrics: the window of steps since the last log line, and what a log step does.

`Window` holds the steps' loss, nll and token sums on the device (no sync). On a log step the
sums are added over the workers in the step's agreement (`pipeline.train.agreement`), and
`TrainLog.log_window` turns them into the progress line and the metrics rank 0 sends to MLflow
(the loop keeps their history in `Progress`). `TrainLog.log` sends any other metrics. MLflow is
imported lazily, and a tracking failure never stops training.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from pipeline.train.checkpoint import Progress

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class Window:
    """Sums since the last log line (device tensors: adding them does not sync); the loop's
    `LoopState.advance` counts each step in them."""

    start: float = field(default_factory=time.perf_counter)
    steps: int = 0
    tokens_src: int = 0
    tokens_tgt: int = 0
    loss: torch.Tensor | None = None
    nll: torch.Tensor | None = None
    lr: float = 0.0  # the rate the last step used
    grad_norm: float = float("nan")  # of the last step (computed on log steps only)


class TrainLog:
    """Rank 0's metrics: the progress line, the history kept in checkpoints, MLflow."""

    def __init__(self, progress: Progress, max_steps: int, rank: int, tracking_uri: str | None, run_id: str | None,
                 buffer_s: float = 1800.0, spool_dir: str | None = None):
        self.progress, self.max_steps, self.rank = progress, max_steps, rank
        self.tracker = _make_tracker(tracking_uri, run_id, buffer_s, spool_dir) if rank == 0 else None
        self.last: dict[str, float] = {}  # the latest value of every metric (reported with checkpoints)
        self._warned = False

    def log_window(self, w: Window, sums: list[float]) -> dict[str, float] | None:
        """Rank 0: the log line and metrics of the steps of `w`, whose loss and nll `sums` (added
        over the workers) the step's agreement gave; the metrics (None on the other ranks)."""
        if self.rank != 0:
            return None
        loss, nll = sums
        elapsed = time.perf_counter() - w.start
        step_time = elapsed / max(w.steps, 1)
        m = {"train/loss": loss / w.tokens_tgt, "train/nll": nll / w.tokens_tgt,
             "train/ppl": math.exp(min(nll / w.tokens_tgt, 50.0)), "train/lr": w.lr,
             "train/grad_norm": w.grad_norm,
             "train/tgt_tokens_per_s": w.tokens_tgt / elapsed, "train/src_tokens_per_s": w.tokens_src / elapsed,
             "train/step_time_s": step_time}
        self.log(m)
        step = self.progress.step
        log.info("step %d/%d | loss %.4f | nll %.4f | lr %.3g | %.0f tgt tok/s | %.3f s/step | ETA %s",
                 step, self.max_steps, m["train/loss"], m["train/nll"], w.lr,
                 m["train/tgt_tokens_per_s"], step_time, hms((self.max_steps - step) * step_time))
        return m

    def log(self, metrics: dict[str, float]) -> None:
        """Metrics at the current step: kept as the latest values and sent to MLflow (rank 0)."""
        self.last.update(metrics)
        if self.tracker is None:
            return
        try:
            self.tracker.log_metrics(metrics, step=self.progress.step)
        except Exception as e:  # noqa: BLE001 (any store error): tracking must never stop training
            if not self._warned:
                log.warning("could not log metrics to MLflow (%s); training continues", e)
                self._warned = True

    def spool_pending(self) -> None:
        """Before a checkpoint: the points not yet delivered go to the spool, so that a process
        killed after it loses none of them (its resume replays only the later steps)."""
        if self.tracker is not None:
            self.tracker.spool_pending()

    def close(self) -> None:
        """Deliver the buffered metrics, waiting at most a minute for the server; what is left
        goes to the spool (`spool_dir`), which the driver delivers."""
        if self.tracker is not None:
            self.tracker.close()


def _make_tracker(uri: str | None, run_id: str | None, buffer_s: float, spool_dir: str | None = None) -> Any:
    if not run_id:
        return None
    from pipeline.tracking import BufferedRunLogger  # MLflow is imported lazily, on first log

    # Buffered: a log step never waits for the tracking server (its thread does; tracking.buffer_s).
    return BufferedRunLogger(uri, run_id, buffer_s=buffer_s, spool_dir=spool_dir)


def hms(seconds: float) -> str:
    s = int(max(seconds, 0))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"
