"""An MLflow client whose calls to a server fail in bounded time (`TrackingUnavailable`), and how
to tell a server that is away from a wrong request."""

from __future__ import annotations

import threading
from typing import Any, Callable


class TrackingUnavailable(ConnectionError):
    """The tracking server did not answer a driver's call in time (or its retries ran out)."""


class BoundedClient:
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
            if is_connection_error(e):
                raise TrackingUnavailable(f"MLflow tracking server {self._uri} failed {name} after MLflow's "
                                          f"retries ({short_error(e)}); check the server or tracking.uri") from e
            raise e
        return box.get("value")


def is_connection_error(e: BaseException) -> bool:
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


def short_error(e: BaseException) -> str:
    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    return text[:300]

