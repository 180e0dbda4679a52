"""An MLflow tracking server for tests, as the cluster's head node runs one (see cluster.yaml).

    with mlflow_server(tmp_path) as uri:   # http://127.0.0.1:PORT, SQLite store, served artifacts
        MlflowClient(uri)...

Started on 127.0.0.1 on a free port with its own process session, stopped by process id.
Starting it takes ~7 s on 2 cores (AVX512-BF16; its imports and the database migrations), so the suite's tests
share the session's (`mlflow_uri`, tests/integration/conftest.py); the tracking outage tests put a
proxy in front of it that they switch off (tests/support/flaky_proxy.py) instead of stopping it.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from tests.support.procs import BIN, free_port, start, stop, wait_http


class MlflowServer:
    """`mlflow server` on a fixed port; `stop()` and `start()` again for an outage of the server
    itself (benchmarks/elastic_bench.py): the store (SQLite) survives it."""

    def __init__(self, tmp: Path, port: int | None = None):
        self.tmp, self.port = tmp, port or free_port()
        tmp.mkdir(parents=True, exist_ok=True)
        self.uri = f"http://127.0.0.1:{self.port}"
        self.proc = None
        self.start()

    def start(self) -> None:
        cmd = [str(BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(self.port),
               "--backend-store-uri", f"sqlite:///{self.tmp / 'mlflow.db'}",
               "--serve-artifacts", "--artifacts-destination", str(self.tmp / "artifacts"), "--workers", "1"]
        self.proc = start(cmd, self.tmp / "mlflow-server.log")
        try:
            wait_http(f"{self.uri}/health", timeout_s=180, proc=self.proc)
        except BaseException:
            self.stop()
            raise

    def stop(self, timeout_s: float = 5) -> None:
        if self.proc is not None:
            stop(self.proc, timeout_s=timeout_s)  # uvicorn waits for open client connections; SQLite survives a kill
            self.proc = None


@contextmanager
def mlflow_server(tmp: Path) -> Iterator[str]:
    server = None
    try:
        server = MlflowServer(tmp)
        yield server.uri
    finally:
        if server is not None:
            server.stop()
