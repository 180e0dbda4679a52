"""An S3-compatible object store for tests: `moto_server` on 127.0.0.1, stopped by process id.

    with s3_server(tmp_path) as s3:            # a context manager: the server and one bucket
        uri = s3.uri("wd")                     # s3://<bucket>/wd
        env = s3.env                           # AWS_* for subprocesses and Ray nodes

The pytest fixtures below (import them into a test module) also put `s3.env` in `os.environ`
with monkeypatch, so pyarrow (pipeline.storage), boto3 and any Ray node or subprocess started
*afterwards* see the endpoint. Ray workers of a session that is already running keep their old
environment: give them `runtime_env={"env_vars": s3.env}`, or start Ray after the fixture.
"""

from __future__ import annotations

import json
import urllib.request
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

from tests.support.procs import BIN, free_port, start, stop, wait_http

# Fake credentials: moto accepts any (until `require_auth`); never real ones in tests.
FAKE_KEY_ID, FAKE_SECRET = "testing-key-id", "testing-secret"


@dataclass
class S3Server:
    endpoint: str  # http://127.0.0.1:PORT
    bucket: str
    env: dict[str, str]

    def uri(self, *parts: str) -> str:
        return "/".join([f"s3://{self.bucket}", *(p.strip("/") for p in parts)])

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=FAKE_KEY_ID,
                            aws_secret_access_key=FAKE_SECRET, region_name="us-east-1")

    def keys(self, prefix: str = "") -> list[str]:
        """Every object key under `prefix` in the bucket (read with boto3, not with the code under test)."""
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
        return sorted(o["Key"] for page in pages for o in page.get("Contents", []))

    def require_auth(self, enabled: bool) -> None:
        """moto's IAM check: when on, the fake credentials are refused (as wrong credentials are)."""
        count = "0" if enabled else "Infinity"
        req = urllib.request.Request(f"{self.endpoint}/moto-api/reset-auth", data=count.encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        with urllib.request.urlopen(req, timeout=10) as r:
            json.loads(r.read())


def s3_env(endpoint: str) -> dict[str, str]:
    return {"AWS_ACCESS_KEY_ID": FAKE_KEY_ID, "AWS_SECRET_ACCESS_KEY": FAKE_SECRET,
            "AWS_ENDPOINT_URL": endpoint, "AWS_DEFAULT_REGION": "us-east-1", "AWS_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true"}


@contextmanager
def s3_server(tmp: Path, bucket: str | None = None) -> Iterator[S3Server]:
    """Start moto_server on a free port, create one bucket; stop exactly that server at the end."""
    port = free_port()
    proc = start([str(BIN / "moto_server"), "-H", "127.0.0.1", "-p", str(port)], tmp / "moto.log")
    try:
        endpoint = f"http://127.0.0.1:{port}"
        wait_http(f"{endpoint}/moto-api/data.json", timeout_s=60, proc=proc)
        server = S3Server(endpoint, bucket or f"test-{uuid.uuid4().hex[:8]}", s3_env(endpoint))
        server.client().create_bucket(Bucket=server.bucket)
        yield server
    finally:
        # moto keeps serving while clients (pyarrow's pooled connections) hold keep-alive
        # connections open; its state is in memory, so a SIGKILL after a short grace loses nothing.
        stop(proc, timeout_s=3)


# Variables that would override the test server's endpoint or credentials if the machine has them.
_OVERRIDING = ("AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_CONFIG_FILE",
               "AWS_SHARED_CREDENTIALS_FILE")


def use_env(monkeypatch: pytest.MonkeyPatch, server: S3Server) -> None:
    for k in _OVERRIDING:
        monkeypatch.delenv(k, raising=False)
    for k, v in server.env.items():
        monkeypatch.setenv(k, v)


@pytest.fixture(scope="module")
def s3_module(tmp_path_factory) -> Iterator[S3Server]:
    """One moto server per test module (starting one takes a few seconds)."""
    with s3_server(tmp_path_factory.mktemp("s3")) as server:
        yield server


@pytest.fixture
def s3(s3_module: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """The module's S3 server, with its endpoint and fake credentials in this test's environment."""
    use_env(monkeypatch, s3_module)
    return s3_module
