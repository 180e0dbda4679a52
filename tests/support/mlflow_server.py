"""An MLflow tracking server for tests, as the cluster's head node runs one (see cluster.yaml).

    with mlflow_server(tmp_path) as uri:   # http://127.0.0.1:PORT, SQLite store, served artifacts
        MlflowClient(uri)...

Started on 127.0.0.1 on a free port with its own process session, stopped by process id.
Starting it takes ~10-30 s (database migrations), so the fixture is per module.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

from tests.support.procs import BIN, free_port, start, stop, wait_http


@contextmanager
def mlflow_server(tmp: Path) -> Iterator[str]:
    port = free_port()
    cmd = [str(BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port),
           "--backend-store-uri", f"sqlite:///{tmp / 'mlflow.db'}",
           "--serve-artifacts", "--artifacts-destination", str(tmp / "artifacts"), "--workers", "1"]
    proc = start(cmd, tmp / "mlflow-server.log")
    try:
        uri = f"http://127.0.0.1:{port}"
        wait_http(f"{uri}/health", timeout_s=180, proc=proc)
        yield uri
    finally:
        stop(proc, timeout_s=5)  # uvicorn waits for open client connections; SQLite survives a kill


@pytest.fixture(scope="module")
def mlflow_uri(tmp_path_factory) -> Iterator[str]:
    with mlflow_server(tmp_path_factory.mktemp("mlflow")) as uri:
        yield uri
