"""`BufferedRunLogger`: the training loop's metrics, delivered by one thread (`_Delivery`) that does
the waiting when the server is away; what it still holds at the end goes to the run's `MetricSpool`.

`MetricQueue` holds the points between the loop and that thread, and is the only state they
share: each of its public methods takes its lock; the calls to the server and to the spool's storage
happen outside it."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterator

from pipeline.tracking.client import short_error
from pipeline.tracking.loggers import DROPPED_TAG, RunLogger
from pipeline.tracking.spool import LoggerSpool, MetricSpool, Point

log = logging.getLogger("pipeline.tracking")  # one logger name for the package: one switch for all its messages


@dataclass(eq=False)  # compared by identity: the thread removes exactly the points it sent
class QueuedPoint:
    """One `log_metrics` call waiting to be delivered."""

    time: float  # when it was logged (s since the epoch): MLflow's timestamp and its age for buffer_s
    step: int | None
    metrics: dict[str, float]

    def point(self) -> Point:
        """(time, step, metrics): as `RunLogger._send` and the spool take it."""
        return self.time, self.step, self.metrics


class MetricQueue:
    """The points waiting for delivery, oldest first: those loaded from the run's spool, which the
    limits never drop (they are on disk), then the logger's own, which are dropped oldest first
    past `max_points` or once older than `buffer_s`. Also what the thread needs to know with them:
    the drops (`dropped`, of which `dropped_tagged` are in the run's tag), the spool files whose
    points it holds, and whether the logger is closing or has stopped waiting for the thread."""

    def __init__(self, max_points: int, buffer_s: float):
        self.max_points, self.buffer_s = max_points, buffer_s
        self._cond = threading.Condition()
        self._spooled: deque[QueuedPoint] = deque()
        self._own: deque[QueuedPoint] = deque()
        self._spool_files: list[str] = []  # removed once their points are delivered
        self._closing = False  # no new points; the thread ends once the queue is empty
        self._stopped = False  # close() gave up waiting: the thread ends at its next turn
        self.dropped = 0
        self.dropped_tagged = 0

    def __len__(self) -> int:
        with self._cond:
            return len(self._spooled) + len(self._own)

    def _points(self) -> Iterator[QueuedPoint]:
        return itertools.chain(self._spooled, self._own)

    def _empty(self) -> bool:
        return not self._spooled and not self._own

    def put(self, point: QueuedPoint) -> None:
        with self._cond:
            if self._closing:
                raise RuntimeError("BufferedRunLogger is closed")
            self._own.append(point)
            if len(self._own) > self.max_points:
                self._drop(len(self._own) - self.max_points, f"more than {self.max_points} points waiting")
            self._cond.notify()

    def put_spooled(self, points: list[Point], files: list[str], dropped: int) -> None:
        """An earlier logger's spooled `points` go first: ahead of the own ones and of those this
        logger already spooled at a checkpoint (logged later). Its `dropped` join the count to tag.
        Called before the thread's first send: no batch is in flight."""
        with self._cond:
            self._spooled.extendleft(reversed([QueuedPoint(t, step, m) for t, step, m in points]))
            self._spool_files = files + self._spool_files
            self.dropped += dropped

    def own(self) -> list[QueuedPoint]:
        """The own points waiting, oldest first (what a checkpoint spools)."""
        with self._cond:
            return list(self._own)

    def spooled(self, points: list[QueuedPoint], file: str) -> bool:
        """The own `points` are now also in the spool `file`: those still waiting join the spooled
        ones (on disk: the limits no longer drop them), and the file is removed with theirs. False
        when none is still waiting (delivered or dropped meanwhile): the caller removes the file.
        Those still waiting lead the own ones, since points leave only from the head."""
        written = set(points)
        with self._cond:
            moved = 0
            while self._own and self._own[0] in written:
                self._spooled.append(self._own.popleft())
                moved += 1
            if moved:
                self._spool_files.append(file)
            return moved > 0

    def next_batch(self, n: int) -> list[QueuedPoint] | None:
        """The oldest `n` points, waiting until there are some (the own ones older than `buffer_s`
        dropped first); None when the thread is done: closing with nothing left, or stopped."""
        with self._cond:
            while True:
                while self._empty() and not self._closing:
                    self._cond.wait()
                if self._empty() or self._stopped:
                    return None
                cutoff = time.time() - self.buffer_s
                aged = next((i for i, p in enumerate(self._own) if p.time >= cutoff), len(self._own))
                if aged:
                    self._drop(aged, f"older than tracking.buffer_s={self.buffer_s:g} s")
                if not self._empty():
                    return list(itertools.islice(self._points(), n))

    def remove(self, sent: list[QueuedPoint]) -> list[str]:
        """Forget the delivered `sent`; the spool files whose points are now all delivered. The sent
        points still held lead each deque: a drop during the send took only the oldest own ones."""
        done = set(sent)
        with self._cond:
            for points in (self._spooled, self._own):
                while points and points[0] in done:
                    points.popleft()
            if self._spooled or self._stopped:
                return []
            files, self._spool_files = self._spool_files, []
            return files

    def untagged_drops(self) -> int:
        with self._cond:
            return self.dropped - self.dropped_tagged

    def tagged(self, n: int) -> None:
        with self._cond:
            self.dropped_tagged += n

    def wait_to_retry(self, retry_s: float) -> None:
        """Wait `retry_s`, at most 1 s once closing (close() waits for the thread's next try)."""
        with self._cond:
            self._cond.wait(min(retry_s, 1.0) if self._closing else retry_s)

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify()

    def stop(self) -> tuple[list[Point], int, list[str]]:
        """End the thread at its next turn; what is left: the points, the drops not in the tag, the
        loaded spool files (their points are among those left)."""
        with self._cond:
            self._stopped = True
            return [p.point() for p in self._points()], self.dropped - self.dropped_tagged, list(self._spool_files)

    def _drop(self, n: int, why: str) -> None:
        """Drop the `n` oldest own points (the caller holds the lock)."""
        for _ in range(n):
            self._own.popleft()
        self.dropped += n
        log.warning("tracking: dropped the %d oldest metric point(s) (%s; %d dropped in all)", n, why, self.dropped)


class BufferedRunLogger(RunLogger):
    """`log_metrics` returns at once: the points wait in a `MetricQueue` that one thread delivers,
    in logging order, in batches; the waiting for a server that is away happens there.

    The thread sends with MLflow's client (its HTTP retries: MLFLOW_HTTP_REQUEST_MAX_RETRIES,
    ..._BACKOFF_FACTOR), and when those run out it keeps the batch at the head of the queue and
    tries again every `retry_s`, so an outage of any length up to `buffer_s` loses nothing.
    Points older than `buffer_s` (or past `max_points`) are dropped oldest first, with a warning;
    the count is added to the run's tag `tracking/dropped_points` once the server answers again. A
    point is sent at most once per (key, step): after a failed call the thread re-reads what the
    run holds (a lost answer to a stored batch is not stored twice). Not thread-safe for several
    loggers of one run in one process (the loop has one, on rank 0), nor for calls from several
    threads (the loop's thread logs and closes).

    With `spool_dir`, nothing is lost when training ends during an outage: `close` writes what is
    still queued to a `MetricSpool` there, and the next logger of the run (a restarted worker)
    queues those points first, before its own, or the driver delivers them (`deliver_spool`).
    Nor when the process is killed: the loop calls `spool_pending` before each checkpoint, so every
    point up to the step a resume starts after is delivered or on disk (the resume replays the
    later ones). Spooled points are on disk: the buffer's limits never drop them."""

    DROPPED_TAG = DROPPED_TAG

    def __init__(self, tracking_uri: str | None, run_id: str | None, buffer_s: float = 1800.0,
                 retry_s: float = 5.0, max_points: int = 200_000, batch_points: int = 100,
                 spool_dir: str | None = None):
        super().__init__(tracking_uri, run_id)
        self.buffer_s, self.retry_s, self.max_points, self.batch_points = buffer_s, retry_s, max_points, batch_points
        self.spool = LoggerSpool(MetricSpool(spool_dir, run_id), tracking_uri) if spool_dir and run_id else None
        self.spooled = 0  # points written to the spool by close()
        self._queue = MetricQueue(max_points, buffer_s)
        self._thread: threading.Thread | None = None  # `_Delivery`'s, started by the first point

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("BufferedRunLogger holds a thread: make one per process (pickle a RunLogger)")

    @property
    def dropped(self) -> int:
        """Points dropped by the buffer's limits: this logger's, and those counted in its spool."""
        return self._queue.dropped

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        if not self.run_id or not metrics:
            return
        self._queue.put(QueuedPoint(time.time(), step, dict(metrics)))
        if self._thread is None:
            self._thread = threading.Thread(target=_Delivery(self).run, name="mlflow-metrics", daemon=True)
            self._thread.start()

    def pending(self) -> int:
        return len(self._queue)

    def spool_pending(self) -> int:
        """Write the points still waiting to the spool, where a later logger of the run (or the
        driver) finds them if this process dies before delivering them; the number written (0:
        none waiting, no spool, or its storage failed: a warning says so, they still wait here).
        The file is removed once its points are delivered. Drops are not written: a process that
        dies leaves its uncounted drops out of the run's tag."""
        points = self._queue.own() if self.spool is not None else []
        uri = self.spool.write([p.point() for p in points], 0, "they wait in memory") if points else None
        if uri is None:
            return 0
        if not self._queue.spooled(points, uri):  # all delivered while it was written
            self.spool.remove([uri])
        return len(points)

    def close(self, timeout_s: float = 60.0) -> bool:
        """Deliver what is queued, waiting at most `timeout_s`; True when nothing is left. What is
        left goes to the spool (when there is one), else it is lost (a warning says which)."""
        self._queue.close()
        if self._thread is not None:
            self._thread.join(timeout_s)
        left, untagged, loaded_files = self._queue.stop()  # a thread still trying ends at its next turn
        if not left and not untagged:
            return True
        if self.spool is None:
            if left:
                log.warning("tracking: %d metric point(s) not delivered to MLflow server %s (still away after "
                            "%.0f s at the end of training); they are lost", len(left), self.tracking_uri, timeout_s)
            return not left
        return self._respool(left, untagged, loaded_files, timeout_s)

    def _respool(self, left: list[Point], untagged: int, loaded_files: list[str], timeout_s: float) -> bool:
        """Spool `left` and the `untagged` drops in one new file, which replaces `loaded_files`."""
        uri = self.spool.write(left, untagged, f"not delivered to MLflow server {self.tracking_uri} either: lost")
        if uri is None:
            return False
        self.spool.remove(loaded_files)  # their points are in the new file
        self.spooled = len(left)
        log.warning("tracking: %d metric point(s) not delivered to MLflow server %s (still away after %.0f s "
                    "at the end of training); spooled in %s: the driver delivers them when the server is "
                    "back", len(left), self.tracking_uri, timeout_s, uri)
        return not left


class _Delivery:
    """A `BufferedRunLogger`'s thread: the run's spooled points first, then the queue's in batches,
    until the logger closes with nothing left; a batch the server does not take stays at the head
    of the queue and is tried again every `retry_s`. Its own state: its MlflowClient (made on its
    first send) and when the server stopped answering."""

    def __init__(self, logger: BufferedRunLogger):
        self.logger, self.queue = logger, logger._queue
        self.client: Any = None
        self.down_since: float | None = None

    def run(self) -> None:
        self._load_spool()
        while (points := self.queue.next_batch(self.logger.batch_points)) is not None:
            if self._send_batch(points):
                self._delivered(points)
            else:
                self.queue.wait_to_retry(self.logger.retry_s)

    def _load_spool(self) -> None:
        """Queue the run's spooled points ahead of the logger's own."""
        spool = self.logger.spool
        files, points, dropped = spool.load() if spool is not None else ([], [], 0)
        if files:
            self.queue.put_spooled(points, files, dropped)
            log.info("tracking: %d metric point(s) spooled by an earlier worker of run %s go first", len(points),
                     self.logger.run_id)

    def _send_batch(self, points: list[QueuedPoint]) -> bool:
        """Send `points`, then add the drops not yet counted to the run's tag; False when the
        server did not take them (they stay queued)."""
        logger = self.logger
        try:
            if self.client is None:
                from mlflow import MlflowClient

                self.client = MlflowClient(logger.tracking_uri)
            logger._send(self.client, [p.point() for p in points])
            untagged = self.queue.untagged_drops()
            if untagged > 0:
                logger._add_dropped(self.client, untagged)
                self.queue.tagged(untagged)
        except Exception as e:  # noqa: BLE001 (any store error: keep the points, try again)
            if self.down_since is None:
                self.down_since = time.time()
                log.warning("tracking: MLflow server %s did not take metrics (%s); training goes on, the "
                            "metrics wait (up to tracking.buffer_s=%g s) and are sent when it is back",
                            logger.tracking_uri, short_error(e), logger.buffer_s)
            return False
        return True

    def _delivered(self, points: list[QueuedPoint]) -> None:
        """Forget the sent `points`; remove the spool files whose points are now all delivered."""
        LoggerSpool.remove(self.queue.remove(points))
        if self.down_since is not None:
            log.warning("tracking: MLflow server %s answers again after %.0f s; delivering the buffered "
                        "metrics (%d point(s) still queued)", self.logger.tracking_uri,
                        time.time() - self.down_since, len(self.queue))
            self.down_since = None
