"""An in-memory stand-in for an MLflow tracking server that a test can take away and bring back.

    store = FakeMlflow(monkeypatch)   # every MlflowClient(...) made from now on talks to it
    run_id = store.create_run()
    store.up = False                  # calls fail like a refused connection, as MLflow's would
    store.metric_steps(run_id, "train/loss")

Only the client calls `pipeline.tracking`'s loggers make (log_batch, get_metric_history, get_run,
set_tag) are served; each stored `Metric` is MLflow's own entity. `batches` records every batch
that was stored, in order, so a test can check the order in which points arrived.
"""

from __future__ import annotations

import threading
import uuid
from types import SimpleNamespace
from typing import Any


class FakeMlflow:
    def __init__(self, monkeypatch: Any):
        import mlflow

        self.up = True
        self.runs: dict[str, dict[str, Any]] = {}
        self.batches: list[list[Any]] = []  # the metrics of each stored log_batch, in order
        self._lock = threading.Lock()
        monkeypatch.setattr(mlflow, "MlflowClient", lambda *a, **kw: _Client(self))

    def create_run(self, status: str = "RUNNING") -> str:
        run_id = uuid.uuid4().hex
        self.runs[run_id] = {"metrics": {}, "tags": {}, "status": status}
        return run_id

    def metric_steps(self, run_id: str, key: str) -> list[int]:
        """The steps of `key` in the order the server received them (duplicates kept)."""
        return [m.step for m in self.runs[run_id]["metrics"].get(key, [])]

    def metric_values(self, run_id: str, key: str) -> dict[int, float]:
        return {m.step: m.value for m in self.runs[run_id]["metrics"].get(key, [])}

    def tags(self, run_id: str) -> dict[str, str]:
        return dict(self.runs[run_id]["tags"])

    def _check(self) -> None:
        if not self.up:
            raise ConnectionRefusedError("[Errno 111] Connection refused (fake MLflow server is down)")


class _Client:
    def __init__(self, store: FakeMlflow):
        self.store = store

    def log_batch(self, run_id: str, metrics: Any = (), params: Any = (), tags: Any = ()) -> None:
        self.store._check()
        with self.store._lock:
            run = self.store.runs[run_id]
            for m in metrics:
                run["metrics"].setdefault(m.key, []).append(m)
            self.store.batches.append(list(metrics))

    def get_metric_history(self, run_id: str, key: str) -> list[Any]:
        self.store._check()
        return list(self.store.runs[run_id]["metrics"].get(key, []))

    def get_run(self, run_id: str) -> Any:
        self.store._check()
        run = self.store.runs[run_id]
        return SimpleNamespace(info=SimpleNamespace(run_id=run_id, status=run["status"]),
                               data=SimpleNamespace(tags=dict(run["tags"])))

    def set_tag(self, run_id: str, key: str, value: Any) -> None:
        self.store._check()
        self.store.runs[run_id]["tags"][key] = str(value)
