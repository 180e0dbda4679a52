"""`RunLogger`: logs to one existing MLflow run from any process (picklable), each metric key at
most once per step."""

from __future__ import annotations

import time
from typing import Any

from pipeline.tracking.client import BoundedClient

_MAX_PARAM_LEN = 6000
DROPPED_TAG = "tracking/dropped_points"


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
            self._client = BoundedClient(self.tracking_uri, self.timeout_s)
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
