"""The only module that talks to MLflow.

One parent run per workflow invocation; one run per (stage, cache key), continued when a crashed
stage reruns (see `Tracking`), and a small nested run for each stage served from cache. A sweep
(workflows/reproduce_table3.py) nests one parent per row in its own run: sweep -> row -> stages.
Embedded default: a SQLite store under the work dir (MLflow's file store is in maintenance mode
in 3.x) with artifacts beside it; ``tracking.uri`` / ``MLFLOW_TRACKING_URI`` name a server.
Ray workers log through ``RunLogger`` (picklable: a URI and a run id); the training loop's
metrics go through ``BufferedRunLogger``, whose thread does the waiting when the server is away;
what it still holds when training ends goes to a ``MetricSpool`` beside the checkpoints, which the
driver (``deliver_spool``: the train stage, the next invocation's start) delivers.
The driver's calls wait at most ``tracking.timeout_s`` for a server (``TrackingUnavailable``).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections import deque
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from pipeline import storage
from pipeline.config import Config

log = logging.getLogger(__name__)

_MAX_PARAM_LEN = 6000
EXPERIMENT_KIND_TAG, EXPERIMENT_KIND = "mlflow.experimentKind", "custom_model_development"


def tracking_uri_for(cfg: Config) -> str:
    if cfg.tracking.uri:
        return cfg.tracking.uri
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    if storage.is_remote(cfg.run.work_dir):
        # SQLite needs a local file: keep the store beside the driver, artifacts in the bucket.
        return f"sqlite:///{Path('mlflow.db').resolve()}"
    return f"sqlite:///{storage.absolute(cfg.run.work_dir)}/mlflow.db"


def artifact_location_for(cfg: Config, uri: str) -> str | None:
    """Where a new experiment keeps artifacts: beside the work dir for the embedded store."""
    if uri.startswith("http"):
        return None  # the server decides (--serve-artifacts or its --default-artifact-root)
    return storage.join(storage.absolute(cfg.run.work_dir), "mlartifacts")


def check_reachable(uri: str, timeout_s: float = 5.0) -> None:
    """Fail fast, before any GPU time, when a tracking server does not answer."""
    if not uri.startswith("http"):
        return
    url = uri.rstrip("/") + "/health"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            if r.status != 200:
                raise ConnectionError(f"status {r.status}")
    except (OSError, urllib.error.URLError, ConnectionError) as e:
        raise ConnectionError(f"MLflow tracking server {uri} is not reachable ({e}); "
                              "check tracking.uri / MLFLOW_TRACKING_URI") from e


class TrackingUnavailable(ConnectionError):
    """The tracking server did not answer a driver's call in time (or its retries ran out)."""


class _BoundedClient:
    """An `MlflowClient` whose calls to a server give up after `timeout_s`, naming the server.

    MLflow's own HTTP retries (MLFLOW_HTTP_REQUEST_MAX_RETRIES, ..._BACKOFF_FACTOR, ..._TIMEOUT)
    can wait several minutes; the driver's bookkeeping must fail in bounded time instead. A call
    runs in a daemon thread joined with a deadline (a call past it is abandoned, not cancelled:
    the driver is failing anyway)."""

    def __init__(self, uri: str | None, timeout_s: float):
        from mlflow import MlflowClient

        self._client, self._uri, self._timeout_s = MlflowClient(uri), uri or "", timeout_s

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._client, name)
        if not callable(fn) or not self._uri.startswith("http"):
            return fn  # a local store answers or fails at once
        return lambda *a, **kw: self._call(name, fn, a, kw)

    def _call(self, name: str, fn: Callable, args: tuple, kwargs: dict) -> Any:
        box: dict[str, Any] = {}

        def target() -> None:
            try:
                box["value"] = fn(*args, **kwargs)
            except BaseException as e:  # noqa: BLE001 (re-raised in the caller's thread)
                box["error"] = e

        t = threading.Thread(target=target, name=f"mlflow-{name}", daemon=True)
        t.start()
        t.join(self._timeout_s)
        if t.is_alive():
            raise TrackingUnavailable(f"MLflow tracking server {self._uri} did not answer {name} within "
                                      f"tracking.timeout_s={self._timeout_s:g} s; check the server or "
                                      "tracking.uri / MLFLOW_TRACKING_URI")
        if "error" in box:
            e = box["error"]
            if _is_connection_error(e):
                raise TrackingUnavailable(f"MLflow tracking server {self._uri} failed {name} after MLflow's "
                                          f"retries ({_short(e)}); check the server or tracking.uri") from e
            raise e
        return box.get("value")


def _is_connection_error(e: BaseException) -> bool:
    """A server that is away (refused, reset, timed out, 5xx after retries), not a wrong request."""
    import requests
    from mlflow.exceptions import MlflowException

    if isinstance(e, (OSError, requests.exceptions.RequestException)):
        return True
    if isinstance(e, MlflowException):
        text = str(e)
        return any(w in text for w in ("Max retries", "Connection", "connection", "timed out", "Timeout",
                                       "503", "502", "500", "504"))
    return False


def _short(e: BaseException) -> str:
    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    return text[:300]


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = str(v)[:_MAX_PARAM_LEN]
    return out


class RunLogger:
    """Logs to one existing MLflow run from any process (Ray workers): picklable."""

    def __init__(self, tracking_uri: str | None, run_id: str | None, timeout_s: float = 300.0):
        self.tracking_uri = tracking_uri
        self.run_id = run_id
        self.timeout_s = timeout_s
        self._client = None
        self._last_step: dict[str, int] = {}  # per key: the highest step MLflow holds

    def __getstate__(self) -> dict[str, Any]:
        return {"tracking_uri": self.tracking_uri, "run_id": self.run_id, "timeout_s": self.timeout_s,
                "_client": None, "_last_step": {}}

    @property
    def client(self):
        if self._client is None:
            self._client = _BoundedClient(self.tracking_uri, self.timeout_s)
        return self._client

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        """Log `metrics` at `step` (0 when None). With an explicit step, each key is logged at most
        once per step: a step at or below the last one the run holds for that key is skipped, so a
        replaced worker or a restarted driver replaying steps from a checkpoint adds no duplicate
        points (the replayed values are the same: the loop is deterministic from a checkpoint)."""
        if not self.run_id or not metrics:
            return
        self._send(self.client, [(time.time(), step, metrics)])

    def _send(self, client: Any, points: list[tuple[float, int | None, dict[str, float]]]) -> None:
        """One `log_batch` of `points` ((time, step, metrics), in logging order), each key at a
        step the run does not hold yet."""
        from mlflow.entities import Metric

        batch, sent = [], {}
        for ts, step, metrics in points:
            for k, v in metrics.items():
                if step is not None and step <= sent.get(k, self._logged_up_to(client, k)):
                    continue
                batch.append(Metric(k, float(v), int(ts * 1000), step or 0))
                if step is not None:
                    sent[k] = step
        if not batch:
            return
        try:
            client.log_batch(self.run_id, metrics=batch)
        except BaseException:
            # The server may have stored the batch and lost only its answer: read what it holds
            # again before the next try, so that a retry adds no duplicate point.
            for k in sent:
                self._last_step.pop(k, None)
            raise
        self._last_step.update(sent)

    def _send_all(self, client: Any, points: list[tuple[float, int | None, dict[str, float]]],
                  batch_points: int = 100) -> None:
        """`_send` in batches of `batch_points`, in order."""
        for i in range(0, len(points), batch_points):
            self._send(client, points[i:i + batch_points])

    def _add_dropped(self, client: Any, n: int) -> None:
        """Add `n` to the run's count of dropped points (tag `tracking/dropped_points`)."""
        if n <= 0:
            return
        held = client.get_run(self.run_id).data.tags.get(DROPPED_TAG, "0")
        client.set_tag(self.run_id, DROPPED_TAG, str(int(held) + n))

    def _logged_up_to(self, client: Any, key: str) -> int:
        """The highest step of `key` in the run (-1: none), read from MLflow once per process."""
        if key not in self._last_step:
            history = client.get_metric_history(self.run_id, key)
            self._last_step[key] = max((m.step for m in history), default=-1)
        return self._last_step[key]

    def log_params(self, params: dict[str, Any]) -> None:
        if not self.run_id or not params:
            return
        from mlflow.entities import Param

        flat = flatten(params)
        batch = [Param(k, v) for k, v in flat.items()]
        for i in range(0, len(batch), 100):
            self.client.log_batch(self.run_id, params=batch[i:i + 100])

    def set_tags(self, tags: dict[str, str]) -> None:
        for k, v in tags.items():
            if self.run_id:
                self.client.set_tag(self.run_id, k, str(v))

    def log_text(self, text: str, artifact_file: str) -> None:
        if self.run_id:
            self.client.log_text(self.run_id, text, artifact_file)

    def log_artifact(self, local_path: str, artifact_path: str | None = None) -> None:
        if self.run_id:
            self.client.log_artifact(self.run_id, str(local_path), artifact_path)

    def log_artifact_uri(self, uri: str, artifact_path: str | None = None) -> None:
        """Log a file that may live in an object store."""
        if not self.run_id:
            return
        with tempfile.TemporaryDirectory() as tmp:
            name = uri.rstrip("/").rsplit("/", 1)[-1]
            local = Path(tmp) / name
            local.write_bytes(storage.read_bytes(uri))
            self.log_artifact(str(local), artifact_path)


DROPPED_TAG = "tracking/dropped_points"
SPOOL_FOLDER = "tracking_spool"
Point = tuple[float, "int | None", dict[str, float]]  # (time, step, metrics), as logged


def spool_dir_for(cfg: Config) -> str:
    """Where undelivered metric points wait: beside the runs' checkpoints (Ray Train's storage
    path, as `pipeline.train.resume.storage_path_for` names it), which every node reads and which
    outlives the worker that logged them."""
    ckpts = storage.absolute(cfg.run.storage_path or storage.join(cfg.run.work_dir, "ray_train"))
    return storage.join(ckpts, SPOOL_FOLDER)


class MetricSpool:
    """The metric points of one run that a `BufferedRunLogger` could not deliver before it closed.

    JSONL files ``<root>/<run_id>/<time_ns>-<pid>-<random>.jsonl``, each written whole (temp file +
    rename locally, one PUT on an object store), their names in writing order. A file's first line
    is a header ({"run_id", "tracking_uri", "dropped"}: points dropped and not yet counted in the
    run's tag), then one point per line ({"time", "step", "metrics"}) in logging order. A later file
    may repeat an earlier one's points (a logger that loaded them and closed again writes them
    before it removes the old files): delivery sends each (key, step) at most once, so a repeat, or
    a delivery run twice, adds no point."""

    def __init__(self, root: str, run_id: str):
        self.root, self.run_id = root, run_id
        self.dir = storage.join(root, run_id)

    def files(self) -> list[str]:
        return [storage.join(self.dir, name) for name, _ in storage.list_files(self.dir)
                if name.endswith(".jsonl") and "/" not in name and not name.startswith(".")]

    def write(self, points: list[Point], dropped: int, tracking_uri: str | None) -> str:
        name = f"{time.time_ns():020d}-{os.getpid()}-{uuid.uuid4().hex[:8]}.jsonl"
        lines = [json.dumps({"run_id": self.run_id, "tracking_uri": tracking_uri, "dropped": int(dropped)})]
        lines += [json.dumps({"time": t, "step": step, "metrics": m}) for t, step, m in points]
        uri = storage.join(self.dir, name)
        storage.write_text(uri, "\n".join(lines) + "\n")
        return uri

    def read(self) -> tuple[list[str], list[Point], int]:
        """The files, their points (oldest file first) and their dropped counts summed."""
        files, points, dropped = self.files(), [], 0
        for uri in files:
            lines = [line for line in storage.read_text(uri).splitlines() if line.strip()]
            dropped += int(json.loads(lines[0]).get("dropped", 0))
            for line in lines[1:]:
                p = json.loads(line)
                points.append((float(p["time"]), p["step"], p["metrics"]))
        return files, points, dropped

    @staticmethod
    def remove(files: list[str]) -> None:
        for uri in files:
            storage.rmtree(uri)


def spooled_run_ids(root: str) -> list[str]:
    """The runs with spooled points under `root`."""
    return sorted({name.split("/", 1)[0] for name, _ in storage.list_files(root)
                   if name.endswith(".jsonl") and name.count("/") == 1})


def deliver_spool(root: str, tracking_uri: str | None, run_id: str | None, timeout_s: float = 300.0) -> int:
    """Deliver the run's spooled points to its MLflow run, in logging order, each (key, step) at
    most once, and remove the files; the number of points that were pending (0: none). A server
    still away leaves them where they are, for the next invocation (a warning says so)."""
    if not run_id or not root:
        return 0
    spool = MetricSpool(root, run_id)
    try:
        files, points, dropped = spool.read()
    except Exception as e:  # noqa: BLE001 (the spool's storage is away: the next invocation tries again)
        log.warning("tracking: could not read the metric spool %s (%s)", spool.dir, _short(e))
        return 0
    if not files:
        return 0
    logger = RunLogger(tracking_uri, run_id, timeout_s)
    try:
        logger._send_all(logger.client, points)
        logger._add_dropped(logger.client, dropped)
    except Exception as e:  # noqa: BLE001 (any store error: the files stay for the next try)
        log.warning("tracking: %d metric point(s) of run %s are still spooled in %s (MLflow did not take "
                    "them: %s); the next invocation delivers them", len(points), run_id, spool.dir, _short(e))
        return len(points)
    spool.remove(files)
    log.info("tracking: delivered %d metric point(s) of run %s that were pending in %s", len(points), run_id,
             spool.dir)
    return len(points)


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
                            "%s (%s); they are lost", len(left), self.tracking_uri, self.spool.dir, _short(e))
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
                        self.spool.dir, _short(e))
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
            log.warning("tracking: could not remove the delivered metric spool files %s (%s)", files, _short(e))

    def _on_failure(self, e: Exception) -> None:
        if self._down_since is None:
            self._down_since = time.time()
            log.warning("tracking: MLflow server %s did not take metrics (%s); training goes on, the metrics "
                        "wait (up to tracking.buffer_s=%g s) and are sent when it is back", self.tracking_uri,
                        _short(e), self.buffer_s)


class Tracking:
    """The workflow's MLflow session: a parent run per invocation, one run per (stage, cache key).

    A stage run is tagged with the work dir, the stage and its cache key. A rerun of a stage that
    did not finish (killed driver: ended as KILLED by `end_dead_runs`; a failure: FAILED) continues
    the same run, so its curves stay one curve; the new parent adopts it (`mlflow.parentRunId`) and
    tags `stage_run.<stage>` with its id. Stages served from cache get a small nested run
    (`cached=true`) that names the run which produced them (`source_run_id`).
    """

    def __init__(self, cfg: Config, label: str = "", tags: dict[str, str] | None = None):
        """`label` prefixes the names of the stage runs ("B1: train"); `tags` go on the parent run
        and on every stage run (e.g. a Table 3 row's ``table3_row``), so runs can be filtered by them."""
        self.label = label
        self.tags = dict(tags or {})
        self.enabled = cfg.tracking.enabled
        self.uri = tracking_uri_for(cfg) if self.enabled else None
        self.cfg = cfg
        self.work_dir = storage.absolute(cfg.run.work_dir)
        self.driver = f"{socket.gethostname()} pid {os.getpid()}"
        self.parent: RunLogger = RunLogger(None, None)
        self._experiment_id: str | None = None
        self.timeout_s = cfg.tracking.timeout_s

    def _client(self) -> _BoundedClient:
        return _BoundedClient(self.uri, self.timeout_s)

    def _experiment(self) -> str:
        if self._experiment_id is not None:
            return self._experiment_id
        client = self._client()
        exp = client.get_experiment_by_name(self.cfg.tracking.experiment)
        if exp is None:
            # MLflow 3's UI opens an experiment without this tag in its GenAI view (traces); this
            # one is model training: runs, params, metric charts (value from MLflow 3.17's UI code).
            self._experiment_id = client.create_experiment(
                self.cfg.tracking.experiment, artifact_location=artifact_location_for(self.cfg, self.uri),
                tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND})
        else:
            self._experiment_id = exp.experiment_id
        return self._experiment_id

    def _runs(self, filter_string: str) -> list[Any]:
        """This work dir's runs matching `filter_string`, newest first (the work dir is compared
        here, not in the filter: a path may hold quotes)."""
        runs = self._client().search_runs(
            [self._experiment()], filter_string, max_results=1000, order_by=["attributes.start_time DESC"])
        return [r for r in runs if r.data.tags.get("work_dir") == self.work_dir]

    def end_dead_runs(self) -> list[str]:
        """End the RUNNING runs of this work dir as KILLED, with an `end_reason` tag; their ids.

        Call only while holding the work-dir lock (workflows/lock.py): one driver per work dir, so
        a run of this work dir still RUNNING then belongs to a driver that died (kill -9, a lost
        node) before it could end its runs."""
        if not self.enabled:
            return []
        check_reachable(self.uri)
        client = self._client()
        ended = []
        for run in self._runs("attributes.status = 'RUNNING'"):
            owner = run.data.tags.get("driver", "an unknown driver")
            reason = (f"its driver ({owner}) died without ending it; found RUNNING at "
                      f"{time.strftime('%Y-%m-%dT%H:%M:%S')} by {self.driver}, which holds the work-dir lock")
            client.set_tag(run.info.run_id, "end_reason", reason)
            client.set_terminated(run.info.run_id, status="KILLED")
            ended.append(run.info.run_id)
            log.warning("tracking: ended MLflow run %s (%s) as KILLED: %s", run.info.run_id,
                        run.info.run_name, reason)
        self.deliver_spools()
        return ended

    def deliver_spools(self) -> int:
        """Deliver the metric points that workers spooled when training ended during an outage
        (`BufferedRunLogger`) and no one has delivered since; how many there were. Runs still
        RUNNING are left to their own stage. Never fails the invocation: what the server does not
        take stays spooled (a warning says so)."""
        if not self.enabled:
            return 0
        root = spool_dir_for(self.cfg)
        try:
            run_ids = spooled_run_ids(root)
        except Exception as e:  # noqa: BLE001 (the storage is away: the next invocation tries again)
            log.warning("tracking: could not list the metric spool %s (%s)", root, _short(e))
            return 0
        total = 0
        for run_id in run_ids:
            try:
                status = self._client().get_run(run_id).info.status
            except Exception as e:  # noqa: BLE001 (a run of another store, deleted, or the server is away)
                log.warning("tracking: spooled metrics of run %s stay in %s (%s)", run_id, root, _short(e))
                continue
            if status != "RUNNING":
                total += deliver_spool(root, self.uri, run_id, self.timeout_s)
        return total

    def _base_tags(self) -> dict[str, str]:
        return {"git_commit": git_commit(), "work_dir": self.work_dir, "driver": self.driver, **self.tags}

    @contextmanager
    def parent_run(self, tags: dict[str, str], run_name: str | None = None,
                   nested_in: str | None = None) -> Iterator[RunLogger]:
        """This invocation's run (named `run_name`, default ``run.name``), the parent of the stage
        runs; with `nested_in` (a run id) itself nested in that run, e.g. a sweep's row in the sweep.
        Only the client API with explicit run ids is used: several parents may be open at once,
        one per thread (MLflow's fluent active-run API is not thread-safe)."""
        if not self.enabled:
            yield self.parent
            return
        check_reachable(self.uri)
        client = self._client()
        nested = {"mlflow.parentRunId": nested_in} if nested_in else {}
        run = client.create_run(self._experiment(), run_name=run_name or self.cfg.run.name,
                                tags={**self._base_tags(), **nested, **tags})
        self.parent = RunLogger(self.uri, run.info.run_id, self.timeout_s)
        self.parent.log_params(self.cfg.to_dict())
        self.parent.log_text(_toml_like(self.cfg.to_dict()), "config/resolved.toml")
        status = "FAILED"
        try:
            yield self.parent
            status = "FINISHED"
        finally:
            client.set_terminated(run.info.run_id, status=status)

    def _previous_run(self, stage: str, key: str) -> Any | None:
        """The newest run that did (or tried to do) this stage's work at this key, if any."""
        runs = self._runs(f"tags.stage = '{stage}' and tags.cache_key = '{key}' and tags.cached = 'false'")
        return runs[0] if runs else None

    @contextmanager
    def stage_run(self, stage: str, key: str, cached: bool, params: dict[str, Any],
                  fresh: bool = False) -> Iterator[RunLogger]:
        """The stage's run: a continued one when its last run at this key ended unfinished (unless
        `fresh`, e.g. --force: the work restarts from scratch), else a new one."""
        if not self.enabled or not self.parent.run_id:
            yield RunLogger(None, None)
            return
        client = self._client()
        previous = self._previous_run(stage, key)
        tags = {"mlflow.parentRunId": self.parent.run_id, "stage": stage, "cache_key": key,
                "cached": str(cached).lower(), **self._base_tags()}
        if not cached and not fresh and previous is not None and previous.info.status in ("KILLED", "FAILED"):
            run_id = previous.info.run_id
            attempt = int(previous.data.tags.get("attempts", "1")) + 1
            client.update_run(run_id, status="RUNNING")
            for k, v in {**tags, "attempts": str(attempt), "continued_from_status": previous.info.status,
                         f"parent_run.{attempt}": self.parent.run_id}.items():
                client.set_tag(run_id, k, v)
            log.info("tracking: stage %s continues MLflow run %s (attempt %d; it ended %s)", stage, run_id,
                     attempt, previous.info.status)
            logger = RunLogger(self.uri, run_id, self.timeout_s)
        else:
            if cached and previous is not None:
                tags["source_run_id"] = previous.info.run_id
            if not cached:
                tags.update({"attempts": "1", "parent_run.1": self.parent.run_id})
            name = f"{self.label}: {stage}" if self.label else stage
            run = client.create_run(self._experiment(), run_name=f"{name}{' (cached)' if cached else ''}",
                                    tags=tags)
            logger = RunLogger(self.uri, run.info.run_id, self.timeout_s)
            logger.log_params(params)
        self.parent.set_tags({f"cache_key.{stage}": key,
                              f"stage_run.{stage}": tags.get("source_run_id", logger.run_id)})
        status = "FAILED"
        try:
            yield logger
            status = "FINISHED"
        finally:
            client.set_terminated(logger.run_id, status=status)


def _toml_like(d: dict[str, Any]) -> str:
    lines = []
    for section, values in d.items():
        lines.append(f"[{section}]")
        for k, v in values.items():
            lines.append(f"{k} = {json.dumps(v)}")
        lines.append("")
    return "\n".join(lines)
