"""The durable metric spool: points a `BufferedRunLogger` had not delivered at a checkpoint, or
could not deliver before it closed, wait beside the checkpoints (`MetricSpool`) until it, a later
logger of the run or the driver (`deliver_spool`) delivers them."""

from __future__ import annotations

import json
import logging
import os
import time
import uuid

from pipeline import storage
from pipeline.config import Config
from pipeline.tracking.client import short_error
from pipeline.tracking.loggers import RunLogger

log = logging.getLogger("pipeline.tracking")  # one logger name for the package: one switch for all its messages

SPOOL_FOLDER = "tracking_spool"
Point = tuple[float, "int | None", dict[str, float]]  # (time, step, metrics), as logged


def spool_dir_for(cfg: Config) -> str:
    """Where undelivered metric points wait: beside the runs' checkpoints (Ray Train's storage
    path, as `pipeline.train.resume.storage_path_for` names it), which every node reads and which
    outlives the worker that logged them."""
    ckpts = storage.absolute(cfg.run.storage_path or storage.join(cfg.run.work_dir, "ray_train"))
    return storage.join(ckpts, SPOOL_FOLDER)


class MetricSpool:
    """The metric points of one run that a `BufferedRunLogger` had not delivered at a checkpoint
    (removed once it delivers them) or could not deliver before it closed.

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

    def new_file(self) -> str:
        """A new file's name: after every earlier one in writing order."""
        return storage.join(self.dir, f"{time.time_ns():020d}-{os.getpid()}-{uuid.uuid4().hex[:8]}.jsonl")

    def write(self, uri: str, points: list[Point], dropped: int, tracking_uri: str | None) -> str:
        lines = [json.dumps({"run_id": self.run_id, "tracking_uri": tracking_uri, "dropped": int(dropped)})]
        lines += [json.dumps({"time": t, "step": step, "metrics": m}) for t, step, m in points]
        storage.write_text(uri, "\n".join(lines) + "\n")
        return uri

    def read(self, skip: set[str] = frozenset()) -> tuple[list[str], list[Point], int]:
        """The files (but those in `skip`), their points (oldest file first) and their dropped counts summed."""
        files, points, dropped = [f for f in self.files() if f not in skip], [], 0
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


class LoggerSpool:
    """A `BufferedRunLogger`'s use of its run's `MetricSpool` (`store`), where a storage failure is
    a warning, never an error (training goes on): the files it writes, those of earlier loggers it
    loads (never its own), and the delivered ones it removes."""

    def __init__(self, store: MetricSpool, tracking_uri: str | None):
        self.store, self.tracking_uri = store, tracking_uri
        self._written: set[str] = set()  # the files this logger wrote: `load` does not take them

    def write(self, points: list[Point], dropped: int, then: str) -> str | None:
        """A new file holding `points` and `dropped`; None when the storage failed (the warning
        ends with `then`: what becomes of the points)."""
        uri = self.store.new_file()
        self._written.add(uri)  # before the file exists: a `load` running meanwhile must not take it
        try:
            return self.store.write(uri, points, dropped, self.tracking_uri)
        except Exception as e:  # noqa: BLE001 (any storage error)
            log.warning("tracking: could not spool %d metric point(s) of run %s in %s (%s); %s", len(points),
                        self.store.run_id, self.store.dir, short_error(e), then)
            return None

    def load(self) -> tuple[list[str], list[Point], int]:
        """The files earlier loggers of the run left, their points and drops (`MetricSpool.read`)."""
        try:
            return self.store.read(skip=self._written)
        except Exception as e:  # noqa: BLE001 (the storage is away: the driver delivers them)
            log.warning("tracking: could not read the metric spool %s (%s); the driver delivers it later",
                        self.store.dir, short_error(e))
            return [], [], 0

    @staticmethod
    def remove(files: list[str]) -> None:
        """Remove files whose points are all delivered, or all in a newer file."""
        if not files:
            return
        try:
            MetricSpool.remove(files)
        except Exception as e:  # noqa: BLE001 (left on disk: a later delivery skips what the run holds)
            log.warning("tracking: could not remove the metric spool files %s (%s)", files, short_error(e))


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
        log.warning("tracking: could not read the metric spool %s (%s)", spool.dir, short_error(e))
        return 0
    if not files:
        return 0
    logger = RunLogger(tracking_uri, run_id, timeout_s)
    try:
        logger._send_all(logger.client, points)
        logger._add_dropped(logger.client, dropped)
    except Exception as e:  # noqa: BLE001 (any store error: the files stay for the next try)
        log.warning("tracking: %d metric point(s) of run %s are still spooled in %s (MLflow did not take "
                    "them: %s); the next invocation delivers them", len(points), run_id, spool.dir, short_error(e))
        return len(points)
    spool.remove(files)
    log.info("tracking: delivered %d metric point(s) of run %s that were pending in %s", len(points), run_id,
             spool.dir)
    return len(points)
