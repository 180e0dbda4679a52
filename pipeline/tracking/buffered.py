"""`BufferedRunLogger`: the training loop's metrics, delivered by one thread that does the waiting
when the server is away; what it still holds at the end goes to the run's `MetricSpool`."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from typing import Any

from pipeline.tracking.client import short_error
from pipeline.tracking.loggers import DROPPED_TAG, RunLogger
from pipeline.tracking.spool import MetricSpool

log = logging.getLogger("pipeline.tracking")  # one logger for the package, as before the split


class BufferedRunLogger(RunLogger):
    """`log_metrics` returns at once: the points wait in a queue that one thread delivers, in
    logging order, in batches; the waiting for a server that is away happens there.

    The thread sends with MLflow's client (its HTTP retries: MLFLOW_HTTP_REQUEST_MAX_RETRIES,
    ..._BACKOFF_FACTOR), and when those run out it keeps the batch at the head of the queue and
    tries again every `retry_s`, so an outage of any length up to `buffer_s` loses nothing.
    Points older than `buffer_s` (or past `max_points`) are dropped oldest first, with a warning;
    the count is added to the run's tag `tracking/dropped_points` once the server answers again. A
    point is sent at most once per (key, step): after a failed call the thread re-reads what the
    run holds (a lost answer to a stored batch is not stored twice). Not thread-safe for several
    loggers of one run in one process (the loop has one, on rank 0).

    With `spool_dir`, nothing is lost when training ends during an outage: `close` writes what is
    still queued to a `MetricSpool` there, and the next logger of the run (a restarted worker)
    queues those points first, before its own, or the driver delivers them (`deliver_spool`).
    Spooled points are on disk: the buffer's limits never drop them."""

    DROPPED_TAG = DROPPED_TAG

    def __init__(self, tracking_uri: str | None, run_id: str | None, buffer_s: float = 1800.0,
                 retry_s: float = 5.0, max_points: int = 200_000, batch_points: int = 100,
                 spool_dir: str | None = None):
        super().__init__(tracking_uri, run_id)
        self.buffer_s, self.retry_s, self.max_points, self.batch_points = buffer_s, retry_s, max_points, batch_points
        # seq, time, step, metrics; points loaded from the spool lead, with seq < 0
        self._queue: deque[tuple[int, float, int | None, dict[str, float]]] = deque()
        self._seq = 0
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closing = False
        self._stopped = False  # close() gave up waiting: the thread stops at its next turn
        self.dropped = 0
        self._dropped_tagged = 0
        self._down_since: float | None = None
        self.spool = MetricSpool(spool_dir, run_id) if spool_dir and run_id else None
        self._spool_loaded = False
        self._spool_files: list[str] = []  # loaded into the queue; removed once their points are delivered
        self._spooled_queued = 0  # the queue's leading points that came from the spool
        self.spooled = 0  # points written to the spool by close()

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("BufferedRunLogger holds a thread: make one per process (pickle a RunLogger)")

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        if not self.run_id or not metrics:
            return
        with self._cond:
            if self._closing:
                raise RuntimeError("BufferedRunLogger is closed")
            self._seq += 1
            self._queue.append((self._seq, time.time(), step, dict(metrics)))
            waiting = len(self._queue) - self._spooled_queued
            if waiting > self.max_points:
                self._drop(waiting - self.max_points, f"more than {self.max_points} points waiting")
            self._cond.notify()
        if self._thread is None:
            self._thread = threading.Thread(target=self._deliver, name="mlflow-metrics", daemon=True)
            self._thread.start()

    def pending(self) -> int:
        with self._cond:
            return len(self._queue)

    def close(self, timeout_s: float = 60.0) -> bool:
        """Deliver what is queued, waiting at most `timeout_s`; True when nothing is left. What is
        left goes to the spool (when there is one), else it is lost (a warning says which)."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout_s)
        with self._cond:
            self._stopped = True  # a thread still trying stops at its next turn
            left = [p[1:] for p in self._queue]
            undelivered_drops = self.dropped - self._dropped_tagged
            old_files = list(self._spool_files)
        if not left and not undelivered_drops:
            return True
        if self.spool is not None:
            try:
                uri = self.spool.write(left, undelivered_drops, self.tracking_uri)
                MetricSpool.remove(old_files)  # their points are in the new file
            except Exception as e:  # noqa: BLE001 (the spool's storage failed too)
                log.warning("tracking: %d metric point(s) not delivered to MLflow server %s and not spooled in "
                            "%s (%s); they are lost", len(left), self.tracking_uri, self.spool.dir, short_error(e))
                return False
            self.spooled = len(left)
            log.warning("tracking: %d metric point(s) not delivered to MLflow server %s (still away after %.0f s "
                        "at the end of training); spooled in %s: the driver delivers them when the server is "
                        "back", len(left), self.tracking_uri, timeout_s, uri)
            return not left
        if left:
            log.warning("tracking: %d metric point(s) not delivered to MLflow server %s (still away after "
                        "%.0f s at the end of training); they are lost", len(left), self.tracking_uri, timeout_s)
        return not left

    def _drop(self, n: int, why: str) -> None:
        """Drop the `n` oldest points the buffer holds (the caller holds the lock); the spooled
        points that lead the queue stay."""
        for _ in range(n):
            if self._spooled_queued:
                del self._queue[self._spooled_queued]
            else:
                self._queue.popleft()
        self.dropped += n
        log.warning("tracking: dropped the %d oldest metric point(s) (%s; %d dropped in all)", n, why, self.dropped)

    def _load_spool(self) -> None:
        """Queue the run's spooled points ahead of this logger's own (the thread, once)."""
        self._spool_loaded = True
        if self.spool is None:
            return
        try:
            files, points, dropped = self.spool.read()
        except Exception as e:  # noqa: BLE001 (the spool's storage is away: the driver delivers them)
            log.warning("tracking: could not read the metric spool %s (%s); the driver delivers it later",
                        self.spool.dir, short_error(e))
            return
        if not files:
            return
        with self._cond:
            for i, (t, step, m) in enumerate(reversed(points)):
                self._queue.appendleft((-1 - i, t, step, m))
            self._spooled_queued = len(points)
            self._spool_files = files
            self.dropped += dropped
        log.info("tracking: %d metric point(s) spooled by an earlier worker of run %s go first", len(points),
                 self.run_id)

    def _deliver(self) -> None:
        client = None
        while True:
            if not self._spool_loaded:
                self._load_spool()
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if not self._queue or self._stopped:
                    return
                cutoff = time.time() - self.buffer_s
                s = self._spooled_queued
                old = next((i for i, p in enumerate(itertools.islice(self._queue, s, None)) if p[1] >= cutoff),
                           len(self._queue) - s)
                if old:
                    self._drop(old, f"older than tracking.buffer_s={self.buffer_s:g} s")
                if not self._queue:
                    continue
                points = list(itertools.islice(self._queue, self.batch_points))
            try:
                if client is None:
                    from mlflow import MlflowClient

                    client = MlflowClient(self.tracking_uri)
                self._send(client, [p[1:] for p in points])
                if self.dropped > self._dropped_tagged:
                    n = self.dropped
                    self._add_dropped(client, n - self._dropped_tagged)
                    self._dropped_tagged = n
            except Exception as e:  # noqa: BLE001 (any store error: keep the points, try again)
                self._on_failure(e)
                with self._cond:
                    if not self._closing:
                        self._cond.wait(self.retry_s)
                    else:
                        self._cond.wait(min(self.retry_s, 1.0))
                continue
            with self._cond:
                while self._queue and self._queue[0][0] <= points[-1][0]:
                    if self._queue.popleft()[0] < 0:
                        self._spooled_queued -= 1
                done_files = self._spool_files if not self._spooled_queued and not self._stopped else []
                if done_files:
                    self._spool_files = []
            if done_files:
                self._remove_spooled(done_files)
            if self._down_since is not None:
                log.warning("tracking: MLflow server %s answers again after %.0f s; delivering the buffered "
                            "metrics (%d point(s) still queued)", self.tracking_uri,
                            time.time() - self._down_since, self.pending())
                self._down_since = None

    def _remove_spooled(self, files: list[str]) -> None:
        try:
            MetricSpool.remove(files)
        except Exception as e:  # noqa: BLE001 (left on disk: a later delivery skips what the run holds)
            log.warning("tracking: could not remove the delivered metric spool files %s (%s)", files, short_error(e))

    def _on_failure(self, e: Exception) -> None:
        if self._down_since is None:
            self._down_since = time.time()
            log.warning("tracking: MLflow server %s did not take metrics (%s); training goes on, the metrics "
                        "wait (up to tracking.buffer_s=%g s) and are sent when it is back", self.tracking_uri,
                        short_error(e), self.buffer_s)
