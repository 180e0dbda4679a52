"""The cluster's services in miniature: an MLflow server, an S3 store and a Ray head with token auth.

The Ray head is started the way cluster.yaml starts it: `RAY_AUTH_MODE=token`, the object store's
endpoint and `MLFLOW_TRACKING_URI` exported before `ray start`, so the job's driver (which runs on
the head, with the head's environment) finds both without any of it in a config file.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import time
import zipfile

import pytest

from pipeline.dag import ORDER
from pipeline.stage import MANIFEST, Stage, StageResult
from pipeline import storage
from tests.support.procs import BIN, RayHead
from tests.support.s3 import s3_module, use_env  # noqa: F401 (fixture)
from workflows import reproduce_base, session

REPO = reproduce_base.REPO
EXPERIMENT = "transformer-wmt14-ende"  # TrackingSection.experiment's default
MAX_UPLOAD_BYTES = 100 * 1024**2  # what the dashboard accepts for a job's working dir (DASHBOARD_CLIENT_MAX_SIZE)


@pytest.fixture(scope="module")
def cluster_env(s3_module, mlflow_uri):
    """The environment cluster.yaml gives the head node (and so the job's driver)."""
    with pytest.MonkeyPatch.context() as mp:
        use_env(mp, s3_module)
        mp.setenv("MLFLOW_TRACKING_URI", mlflow_uri)
        mp.setenv("RAY_AUTH_MODE", "token")
        mp.setenv("RAY_AUTH_TOKEN", secrets.token_hex(32))  # a throwaway token, never ~/.ray/auth_token
        mp.setenv("PATH", f"{BIN}{os.pathsep}{os.environ['PATH']}")  # `python` = this venv's, as on the nodes
        yield dict(os.environ)


def mlflow_runs(uri: str, run_name: str):
    """(parent run, {stage: nested run}) of the invocation named `run_name`."""
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(EXPERIMENT)
    (parent,) = client.search_runs([exp.experiment_id], f"attributes.run_name = '{run_name}'")
    children = client.search_runs([exp.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    return parent, {r.data.tags["stage"]: r for r in children}


@pytest.mark.slow
@pytest.mark.timeout(600)  # a cluster, an S3 server and an MLflow server start here first
def test_runner_tracks_to_the_mlflow_server(cluster_env, s3_module, mlflow_uri, monkeypatch, tmp_path):
    """Params, metrics and artifacts of a workflow, read back through the server (fake stage bodies)."""
    from mlflow import MlflowClient

    def fake_load(stage: Stage):
        def body(ctx):
            storage.write_text(storage.join(ctx.out_dir, "out.txt"), ctx.name)
            return StageResult(outputs={}, metrics={f"{ctx.name}/rows": 3.0})
        return body

    monkeypatch.setattr(Stage, "load", fake_load)
    monkeypatch.setattr(session, "ensure_ray", lambda cfg: False)
    monkeypatch.setattr(session, "check_ray", lambda cfg, runs: None)  # no Ray, so no cluster to check
    work_dir = s3_module.uri("tracked")
    assert reproduce_base.main([f"--run.work_dir={work_dir}", "--run.name=fake-stages"]) == 0

    parent, children = mlflow_runs(mlflow_uri, "fake-stages")
    assert parent.info.status == "FINISHED"
    assert parent.data.params["run.work_dir"] == work_dir and parent.data.params["train.max_steps"] == "100000"
    assert parent.data.metrics["prepare/rows"] == 3.0
    assert sorted(children) == sorted(ORDER) and {r.data.tags["cached"] for r in children.values()} == {"false"}
    assert children["vocab"].data.metrics["vocab/rows"] == 3.0
    assert children["vocab"].data.params["vocab.size"] == "37000"

    client = MlflowClient(mlflow_uri)  # artifacts go through the server (--serve-artifacts)
    config = client.download_artifacts(parent.info.run_id, "config/resolved.toml", str(tmp_path))
    assert work_dir in open(config).read()
    manifest = json.load(open(client.download_artifacts(children["train"].info.run_id, "manifest.json",
                                                        str(tmp_path))))
    assert manifest["stage"] == "train" and manifest["dir"].startswith(f"{work_dir}/train/")


def ray_package(tmp_path) -> zipfile.ZipFile:
    """The working-dir package `ray job submit --working-dir .` uploads, built by Ray's own code."""
    from ray._private import ray_constants
    from ray._private.runtime_env.packaging import create_package

    target = tmp_path / "pkg.zip"
    create_package(str(REPO), target, include_gitignore=True,
                   excludes=ray_constants.get_runtime_env_default_excludes())
    return zipfile.ZipFile(target)


def test_the_uploaded_package_is_small_and_clean(tmp_path):
    pkg = ray_package(tmp_path)
    size = (tmp_path / "pkg.zip").stat().st_size
    assert size < MAX_UPLOAD_BYTES / 10, f"{size / 2**20:.1f} MiB: exclude big files in .rayignore"
    names = pkg.namelist()
    assert "workflows/reproduce_base.py" in names and "pipeline/storage.py" in names
    bad = [n for n in names if n.split("/")[0] in (".git", ".venv", "work", "outputs", "mlruns", ".ci")
           or n.endswith((".pt", ".db", ".parquet"))]
    assert not bad, bad


def submit(head: RayHead, *args: str, timeout_s: float = 420) -> subprocess.CompletedProcess:
    cmd = [str(BIN / "ray"), "job", "submit", "--address", head.dashboard, "--working-dir", ".", "--", *args]
    deadline = time.time() + 60
    while True:  # the head's job agent registers a little after the dashboard answers
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
        if "No available agent" not in proc.stdout + proc.stderr or time.time() > deadline:
            return proc
        time.sleep(3)


# The whole DAG at toy size: a small data sample, a tiny model, 10 steps, 20 test sentences decoded.
TINY = ["--config", "configs/local.toml", "--data.corpora=", "--data.max_pairs_per_corpus=300", "--vocab.size=300",
        "--vocab.sample_sentences=1000", "--model.d_model=32", "--model.d_ff=64", "--model.n_heads=2",
        "--model.n_encoder_layers=1", "--model.n_decoder_layers=1", "--train.max_steps=10",
        "--train.warmup_steps=5", "--checkpoint.interval_steps=5", "--metrics.log_interval_steps=5",
        "--metrics.val_loss_interval_steps=10", "--checkpoint.num_to_keep=2", "--average.checkpoints=2",
        "--decode.beam_size=2", "--decode.max_len_a=0", "--decode.max_len_b=5", "--score.max_sentences=20",
        "--dev_bleu.enabled=false", "--speed.precision=fp32"]  # dev BLEU while training: test_dev_bleu.py, test_end_to_end.py


@pytest.mark.slow
@pytest.mark.timeout(1200)  # two job submissions of the whole DAG, each waited up to 420 s
def test_job_submit_runs_the_dag_on_s3_and_a_rerun_is_cached(cluster_env, s3_module, mlflow_uri, synthetic_mirror,
                                                             tmp_path):
    """`ray job submit` of the workflow to a Ray head, work dir in the bucket, tracking to the server."""
    from mlflow import MlflowClient

    work_dir = s3_module.uri("dag")
    args = ["python", "workflows/reproduce_base.py", *TINY, f"--data.mirror={synthetic_mirror}",
            f"--run.work_dir={work_dir}"]
    head = RayHead(tmp_path, num_cpus=2)
    try:
        first = submit(head, *args, "--run.name=job-first")
        keys_after_first = s3_module.keys("dag/")
        second = submit(head, *args, "--run.name=job-rerun")
    finally:
        head.stop()
    assert first.returncode == 0, (first.stdout + first.stderr)[-5000:]
    assert second.returncode == 0, (second.stdout + second.stderr)[-5000:]

    keys = keys_after_first
    for name in ORDER:
        assert any(k.startswith(f"dag/{name}/") and k.endswith(MANIFEST) for k in keys), (name, keys)
    assert any(k.startswith("dag/encode/") and k.endswith(".parquet") for k in keys)  # shards
    assert any(k.startswith("dag/ray_train/") and k.endswith("/model.pt") for k in keys)  # checkpoints
    assert any(k.startswith("dag/average/") and k.endswith("/model.pt") for k in keys)  # averaged model
    assert any(k.startswith("dag/translate/") and k.endswith("hyps.test.txt") for k in keys)  # hypotheses
    assert "dag/.lock" not in keys

    # The rerun: every stage served from the bucket, nothing written there.
    assert "every selected stage is cached" in second.stdout + second.stderr
    assert s3_module.keys("dag/") == keys

    # Tracking reached the server from the driver (via the head's MLFLOW_TRACKING_URI) and from the
    # Ray Train worker (the URI the driver handed on).
    parent, children = mlflow_runs(mlflow_uri, "job-first")
    assert parent.info.status == "FINISHED" and sorted(children) == sorted(ORDER)
    assert parent.data.params["run.work_dir"] == work_dir and parent.data.params["model.d_model"] == "32"
    assert "test/bleu_sacre" in parent.data.metrics
    client = MlflowClient(mlflow_uri)
    assert client.get_metric_history(children["train"].info.run_id, "train/loss")
    assert "manifest.json" in [a.path for a in client.list_artifacts(children["score"].info.run_id)]
    config = client.download_artifacts(parent.info.run_id, "config/resolved.toml", str(tmp_path))
    assert work_dir in open(config).read()
    _, rerun = mlflow_runs(mlflow_uri, "job-rerun")
    assert {r.data.tags["cached"] for r in rerun.values()} == {"true"}
