"""The work dir on an object store: `pipeline.storage` and the runner against a local S3 server.

On a cluster every node reads and writes `s3://...` (DESIGN.md, "Where it runs"); here moto_server
plays S3. What is in the bucket is read back with boto3, not with the code under test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pyarrow.fs as pafs
import pytest

from pipeline import storage
from pipeline.dag import ORDER
from pipeline.stage import MANIFEST, Stage, StageResult
from tests.support.procs import free_port
from tests.support.s3 import s3, s3_module  # noqa: F401 (fixtures)
from workflows import reproduce_base, session

REPO = reproduce_base.REPO


def test_storage_round_trip(s3, tmp_path):
    base = s3.uri("round-trip")
    storage.write_json(storage.join(base, "a/b.json"), {"x": [1, 2]})
    assert storage.read_json(storage.join(base, "a/b.json")) == {"x": [1, 2]}
    assert storage.exists(storage.join(base, "a/b.json")) and not storage.exists(storage.join(base, "nope"))

    local = tmp_path / "local"
    (local / "sub").mkdir(parents=True)
    (local / "one.txt").write_text("1")
    (local / "sub" / "two.bin").write_bytes(b"\x00" * 1000)
    storage.upload(local, storage.join(base, "up"))
    assert storage.list_files(storage.join(base, "up")) == [("one.txt", 1), ("sub/two.bin", 1000)]
    assert s3.keys("round-trip/up/") == ["round-trip/up/one.txt", "round-trip/up/sub/two.bin"]

    # A downloaded copy; rewriting the object must not serve the stale copy.
    got = storage.local_copy(storage.join(base, "up/one.txt"), cache_dir=tmp_path / "cache")
    assert got.read_text() == "1"
    time.sleep(1.1)  # S3 mtimes have one-second resolution
    storage.write_text(storage.join(base, "up/one.txt"), "22")
    assert storage.local_copy(storage.join(base, "up/one.txt"), cache_dir=tmp_path / "cache").read_text() == "22"
    folder = storage.local_copy(storage.join(base, "up"), cache_dir=tmp_path / "cache")
    assert (folder / "sub" / "two.bin").stat().st_size == 1000

    assert storage.sha256(storage.join(base, "up/sub/two.bin")) == storage.sha256(str(local / "sub" / "two.bin"))
    storage.rmtree(storage.join(base, "up"))
    assert not storage.exists(storage.join(base, "up")) and s3.keys("round-trip/up/") == []

    # The cached file system resolves paths exactly as pyarrow's own from_uri does.
    for uri in (base, base + "/", storage.join(base, "a/b.json")):
        assert storage.resolve(uri)[1] == pafs.FileSystem.from_uri(uri)[1].rstrip("/")


def test_metric_spool_on_s3_outlives_a_killed_worker(s3, monkeypatch):
    """The spool beside the checkpoints in the bucket: what a worker spooled at its checkpoint while
    the tracking server was away, then killed, the next worker of the run delivers, then removes."""
    from pipeline.tracking import SPOOL_FOLDER, BufferedRunLogger
    from tests.support.fake_mlflow import FakeMlflow

    store = FakeMlflow(monkeypatch)
    run_id = store.create_run()
    root = s3.uri("wd/ray_train", SPOOL_FOLDER)
    store.up = False
    first = BufferedRunLogger("fake", run_id, retry_s=0.01, spool_dir=root)
    for step in range(1, 5):
        first.log_metrics({"train/loss": 1.0 / step}, step=step)
    assert first.spool_pending() == 4
    first._queue.stop()  # killed: its thread stops, nothing more is spooled
    prefix = f"wd/ray_train/{SPOOL_FOLDER}/{run_id}/"
    assert len([k for k in s3.keys(prefix) if k.endswith(".jsonl")]) == 1  # (pyarrow adds a folder marker)
    store.up = True
    second = BufferedRunLogger("fake", run_id, retry_s=0.01, spool_dir=root)
    for step in (5, 6):
        second.log_metrics({"train/loss": 1.0 / step}, step=step)
    assert second.close(timeout_s=30)
    assert store.metric_steps(run_id, "train/loss") == [1, 2, 3, 4, 5, 6]
    assert [k for k in s3.keys(prefix) if k.endswith(".jsonl")] == []


@pytest.fixture
def fake_stages(monkeypatch):
    """Stage bodies that write through pipeline.storage and read their upstream outputs."""
    ran: list[str] = []

    def fake_load(stage: Stage):
        def body(ctx):
            ran.append(ctx.name)
            seen = "|".join(storage.read_text(storage.join(ctx.inputs[u].dir, "out.txt")) for u in stage.upstream)
            storage.write_text(storage.join(ctx.out_dir, "out.txt"), f"{ctx.name}({seen})")
            return StageResult(outputs={"out": storage.join(ctx.out_dir, "out.txt")})
        return body

    monkeypatch.setattr(Stage, "load", fake_load)
    monkeypatch.setattr(session, "ensure_ray", lambda cfg: False)  # the fake stages need no Ray
    monkeypatch.setattr(session, "check_ray", lambda cfg, runs: None)  # nor a cluster to check
    return ran


def test_runner_on_an_s3_work_dir_then_fully_cached(s3, fake_stages, capsys):
    work_dir = s3.uri("wd")
    argv = [f"--run.work_dir={work_dir}", "--tracking.enabled=false"]
    assert reproduce_base.main(argv) == 0
    assert fake_stages == ORDER
    keys = s3.keys("wd/")
    for name in ORDER:
        manifests = [k for k in keys if k.startswith(f"wd/{name}/") and k.endswith(MANIFEST)]
        assert len(manifests) == 1, (name, keys)
        body = json.loads(s3.client().get_object(Bucket=s3.bucket, Key=manifests[0])["Body"].read())
        assert body["dir"].startswith(f"{work_dir}/{name}/") and body["files"][0]["path"] == "out.txt"
    assert "wd/.lock" not in keys  # the remote lock is released

    capsys.readouterr()
    assert reproduce_base.main(argv) == 0
    assert fake_stages == ORDER  # nothing ran again
    plan = capsys.readouterr().out
    assert all(f"{name} " in plan for name in ORDER) and " run " not in plan


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "workflows/reproduce_base.py", "--tracking.enabled=false", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})})


def assert_failed_before_any_stage(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr
    assert "run.work_dir: cannot write to" in err and "Traceback" not in err, err
    for n in needles:
        assert n in err, err
    assert "stage download: running" not in err and "download " not in proc.stdout  # no plan, no stage


@pytest.mark.slow
def test_unreachable_object_store_fails_fast(s3):
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    proc = run_cli(f"--run.work_dir={s3.uri('wd-bad')}", env={"AWS_ENDPOINT_URL": endpoint})
    assert_failed_before_any_stage(proc, endpoint, "does not answer", "AWS_ENDPOINT_URL")


def test_missing_bucket_fails_fast(s3):
    proc = run_cli("--run.work_dir=s3://no-such-bucket-here/wd")
    assert_failed_before_any_stage(proc, "bucket 'no-such-bucket-here'", s3.endpoint, "does not exist")


def test_refused_credentials_fail_fast(s3):
    s3.require_auth(True)
    try:
        proc = run_cli(f"--run.work_dir={s3.uri('wd-auth')}")
    finally:
        s3.require_auth(False)
    assert_failed_before_any_stage(proc, "credentials were refused", "AWS_ACCESS_KEY_ID")
    assert s3.keys("wd-auth/") == []
    assert os.environ["AWS_SECRET_ACCESS_KEY"] not in proc.stderr + proc.stdout


def test_credentials_in_a_config_uri_are_refused(s3):
    proc = run_cli(f"--run.work_dir=s3://AKIAEXAMPLE:s3cr3t@{s3.bucket}/wd")
    assert proc.returncode == 2
    assert "run.work_dir: embeds credentials" in proc.stderr and "s3cr3t" not in proc.stderr + proc.stdout
