"""The `train` stage on Ray Train: 2 CPU workers (gloo), MLflow, worker failure, driver restart.

One local Ray for the session (`ray_local`); every run is a tiny model on synthetic shards.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pipeline.train import driver as train
from pipeline.train import checkpoint as train_checkpoint
from pipeline.config import Config
from pipeline.train.device import cpu_bf16_features
from pipeline.stage import Manifest, StageContext
from tests.support import faults
from tests.support.synthetic import write_reverse_task

# The bound on each test (pytest-timeout): Ray Train runs; the module's baseline run is trained by its first test.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]
VOCAB = 64


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("shards")
    return (write_reverse_task(root / "train", 600, VOCAB, seed=0),
            write_reverse_task(root / "dev", 60, VOCAB, seed=1))


def make_config(work_dir: Path, **train_overrides) -> Config:
    cfg = Config()
    cfg.model.d_model, cfg.model.d_ff, cfg.model.n_heads = 32, 64, 2
    cfg.model.n_encoder_layers = cfg.model.n_decoder_layers = 1
    t, w = cfg.train, cfg.workers
    w.num_workers, w.use_gpu, w.max_failures = 2, False, 1
    t.max_steps, t.tokens_per_step, cfg.speed.max_tokens_per_batch, t.warmup_steps = 30, 1000, 400, 10
    cfg.metrics.log_interval_steps, cfg.metrics.val_loss_interval_steps, cfg.checkpoint.interval_steps = 5, 10, 10
    cfg.checkpoint.num_to_keep = 2
    for k, v in train_overrides.items():
        assert hasattr(t, k), f"train.{k}"
        setattr(t, k, v)
    cfg.average.checkpoints = 2
    cfg.run.work_dir = str(work_dir)
    return cfg.validate()


def make_context(cfg: Config, key: str, shards, tracker=None) -> StageContext:
    splits = {"train": {"dir": str(shards[0])}, "dev": {"dir": str(shards[1])}}
    inputs = {"encode": Manifest(stage="encode", key="e", dir=str(shards[0].parent), outputs={"splits": splits}),
              "vocab": Manifest(stage="vocab", key="v", dir=str(shards[0].parent),
                                outputs={"vocab_size": VOCAB, "pad_id": 0, "bos_id": 2, "eos_id": 3})}
    ctx = StageContext(name="train", key=key, cfg=cfg, out_dir=str(Path(cfg.run.work_dir) / "train" / key),
                       inputs=inputs)
    if tracker is not None:
        ctx.tracker = tracker
    return ctx


def assert_complete_checkpoints(run_dir: Path) -> None:
    """Every checkpoint folder Ray Train left holds all three files (none half-written)."""
    folders = sorted(p for p in run_dir.glob("checkpoint_*") if p.is_dir())
    assert folders
    for folder in folders:
        assert sorted(p.name for p in folder.iterdir()) == sorted(train_checkpoint.FILES), folder


@pytest.fixture(scope="module")
def baseline(ray_local, shards, tmp_path_factory):
    """One uninterrupted 2-worker run with an MLflow run as its tracker."""
    import mlflow

    from pipeline.tracking import RunLogger

    work = tmp_path_factory.mktemp("baseline")
    uri = f"sqlite:///{work}/mlflow.db"
    client = mlflow.MlflowClient(uri)
    exp = client.create_experiment("train-test", artifact_location=str(work / "mlartifacts"))
    run_id = client.create_run(exp).info.run_id
    cfg = make_config(work)
    result = train.run(make_context(cfg, "baseline", shards, RunLogger(uri, run_id)))
    return cfg, result, client, run_id


def test_two_workers_train_checkpoint_and_log(baseline):
    cfg, result, client, run_id = baseline
    out = result.outputs
    assert out["final_step"] == 30 and out["resumed_from_step"] == 0
    run_dir = Path(out["storage_path"]) / "baseline"
    assert out["checkpoints"] == [str(run_dir / "checkpoint_0000020"), str(run_dir / "checkpoint_0000030")]
    assert_complete_checkpoints(run_dir)
    assert json.loads((run_dir / "checkpoint_0000030" / "meta.json").read_text())["step"] == 30
    assert out["tokens_seen"]["tgt"] > 30 * 500 and out["model_config"]["vocab_size"] == VOCAB
    # The loss falls, in MLflow as in the outputs.
    history = client.get_metric_history(run_id, "train/loss")
    losses = [m.value for m in sorted(history, key=lambda m: m.step)]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.3
    for key in ("train/nll", "train/ppl", "train/lr", "train/grad_norm", "train/tgt_tokens_per_s",
                "train/src_tokens_per_s", "train/step_time_s", "val/loss", "val/ppl"):
        assert client.get_metric_history(run_id, key), key
    assert [m.step for m in client.get_metric_history(run_id, "val/loss")] == [10, 20, 30]
    artifacts = {a.path for a in client.list_artifacts(run_id, "plots")}
    assert artifacts == {"plots/loss.png", "plots/lr.png"}
    assert result.metrics["val/final_ppl"] > 1.0
    # speed.precision = "auto": the workers' choice (bf16 on a CPU with AVX512-BF16/AMX, else fp32),
    # in the outputs and as a tag of the run.
    expected = "bf16" if cpu_bf16_features() else "fp32"
    assert out["precision"] == expected
    assert client.get_run(run_id).data.tags["train.precision_used"] == expected


@pytest.mark.extended
def test_worker_failure_resumes_from_the_latest_checkpoint(ray_local, shards, baseline, tmp_path, monkeypatch):
    """Extended tier (not CI): in CI a lost worker resumed from the latest checkpoint, each step
    logged once and the same losses, is tests/integration/test_cluster_elastic.py; a worker dying
    and the run ending with the uninterrupted run's weights, the next test."""
    from pipeline.tracking import RunLogger

    for k, v in faults.env(17, tmp_path / "failed").items():
        monkeypatch.setenv(k, v)
    cfg = make_config(tmp_path)
    client, uri = baseline[2], f"sqlite:///{baseline[0].run.work_dir}/mlflow.db"
    run_id = client.create_run(client.get_run(baseline[3]).info.experiment_id).info.run_id
    result = train.run(make_context(cfg, "faulty", shards, RunLogger(uri, run_id)))
    assert (tmp_path / "failed").read_text() == "17"  # the failure did happen, on worker 1
    out = result.outputs
    assert out["final_step"] == 30 and out["resumed_from_step"] == 10
    # Step 15 was logged, then the replacement worker replayed 11..17 from checkpoint 10: once.
    assert sorted(m.step for m in client.get_metric_history(run_id, "train/loss")) == [5, 10, 15, 20, 25, 30]
    assert_complete_checkpoints(Path(out["storage_path"]) / "faulty")
    # Resuming replays the lost steps exactly: same weights as the uninterrupted run.
    want = torch.load(Path(baseline[1].outputs["checkpoints"][-1]) / "model.pt", weights_only=True)
    got = torch.load(Path(out["checkpoints"][-1]) / "model.pt", weights_only=True)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=k)


def test_worker_dying_mid_upload_resumes_from_the_previous_complete_checkpoint(ray_local, shards, baseline,
                                                                              tmp_path, monkeypatch):
    # Rank 0's process dies while the step-20 checkpoint is half-uploaded (one file of three
    # at its destination): Ray Train must not take it as the latest, and restarts from step 10.
    for k, v in faults.env(20, tmp_path / "died", "upload").items():
        monkeypatch.setenv(k, v)
    cfg = make_config(tmp_path)
    assert cfg.checkpoint.upload == "async"
    result = train.run(make_context(cfg, "upload", shards))
    assert (tmp_path / "died").read_text() == "20"
    out = result.outputs
    assert out["final_step"] == 30 and out["resumed_from_step"] == 10
    assert_complete_checkpoints(Path(out["storage_path"]) / "upload")
    want = torch.load(Path(baseline[1].outputs["checkpoints"][-1]) / "model.pt", weights_only=True)
    got = torch.load(Path(out["checkpoints"][-1]) / "model.pt", weights_only=True)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=k)


DRIVER = """
import json, logging, sys
logging.basicConfig(level=logging.INFO)
import ray
from pipeline.train import driver as train
from pipeline.config import from_dict
from pipeline.stage import Manifest, StageContext
spec = json.load(open(sys.argv[1]))
ray.init(address=spec["address"], runtime_env={"env_vars": {"PYTHONPATH": spec["repo"]}})
inputs = {k: Manifest(**v) for k, v in spec["inputs"].items()}
ctx = StageContext(name="train", key=spec["key"], cfg=from_dict(spec["cfg"]), out_dir=spec["out_dir"], inputs=inputs)
train.run(ctx)
"""


@pytest.mark.extended
def test_killed_driver_resumes_from_its_checkpoint(ray_local, shards, baseline, tmp_path):
    """Driver 1 (a subprocess on the same Ray) checkpoints step 10, then a worker hangs before step
    11 (test hook) and the driver is killed; driver 2 resumes the run from step 10.

    Extended tier (not CI): in CI, tests/integration/test_crash_recovery.py kills the whole workflow
    driver (kill -9) the same way after a registered checkpoint and checks the rerun resumes from it
    with every step logged once; a resume ending with the uninterrupted run's weights is
    test_worker_dying_mid_upload_resumes_from_the_previous_complete_checkpoint's."""
    cfg = make_config(tmp_path)
    ctx = make_context(cfg, "restart", shards)
    marker = tmp_path / "hung"
    spec = {"address": ray_local.get_runtime_context().gcs_address, "repo": str(REPO), "key": ctx.key,
            "cfg": cfg.to_dict(), "out_dir": ctx.out_dir,
            "inputs": {k: m.to_dict() for k, m in ctx.inputs.items()}}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    (tmp_path / "driver.py").write_text(DRIVER)
    env = {**os.environ, "PYTHONPATH": str(REPO), **faults.env(11, marker, "hang")}
    proc = subprocess.Popen([sys.executable, str(tmp_path / "driver.py"), str(tmp_path / "spec.json")],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    # Ray Train registers a reported checkpoint in its snapshot asynchronously: wait for both.
    snapshot = Path(train.storage_path_for(cfg)) / ctx.key / "checkpoint_manager_snapshot.json"

    def registered() -> bool:
        return snapshot.exists() and "checkpoint_0000010" in snapshot.read_text()

    try:
        deadline = time.monotonic() + 240
        while not (marker.exists() and registered()) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert marker.exists() and registered(), f"driver 1 never reached step 11 (exit code {proc.poll()})"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    result = train.run(ctx)  # a new driver: same run name and storage path, no hook
    out = result.outputs
    assert out["resumed_from_step"] == 10 and out["final_step"] == 30
    assert_complete_checkpoints(Path(out["storage_path"]) / ctx.key)
    want = torch.load(Path(baseline[1].outputs["checkpoints"][-1]) / "model.pt", weights_only=True)
    got = torch.load(Path(out["checkpoints"][-1]) / "model.pt", weights_only=True)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=k)


def test_sigterm_to_a_worker_checkpoints_that_step_and_the_run_resumes_there(ray_local, shards, baseline,
                                                                             tmp_path, monkeypatch):
    """A preemption notice (SIGTERM) to one worker process between checkpoints 10 and 20: the group
    checkpoints at the next agreed step boundary (the signal's step + 1 on two workers), stops, and
    Ray Train's restart resumes there; the result is the uninterrupted run's. The workers wait before
    step 13 until the notice is sent (tests/support/faults.py:gate), so a slow or busy machine never
    lets the run pass step 20 before it."""
    import re
    import threading

    from ray.util.state import list_actors

    cfg = make_config(tmp_path)
    ctx = make_context(cfg, "preempted", shards)
    run_dir = Path(train.storage_path_for(cfg)) / ctx.key
    gate = tmp_path / "gate"
    faults.set_gate(gate, 12)
    for name, value in faults.gate_env(gate).items():
        monkeypatch.setenv(name, value)
    sent: dict = {}

    def preempt() -> None:
        try:
            deadline = time.monotonic() + 240
            while not (run_dir / "checkpoint_0000010").exists():
                if time.monotonic() > deadline:
                    sent["error"] = f"no {run_dir}/checkpoint_0000010 within 240 s: no SIGTERM sent"
                    return
                time.sleep(0.02)
            workers = list_actors(filters=[("class_name", "=", "RayTrainWorker"), ("state", "=", "ALIVE")],
                                  detail=True)
            sent["pid"] = workers[-1].pid
            os.kill(sent["pid"], signal.SIGTERM)
        finally:
            faults.set_gate(gate, 30)

    watcher = threading.Thread(target=preempt, daemon=True)
    watcher.start()
    out = train.run(ctx).outputs
    watcher.join(5)
    assert "pid" in sent, sent.get("error", "the watcher sent no SIGTERM")
    assert out["final_step"] == 30
    logs = "\n".join(p.read_text(errors="replace") for p in
                     Path(ray_local._private.worker._global_node.get_session_dir_path(), "logs").rglob("worker-*")
                     if p.is_file())
    signalled = [int(s) for s in re.findall(r"got SIGTERM during step (\d+)", logs)]
    stopped = re.findall(r"the group stops at step (\d+) after a checkpoint", logs)
    assert len(signalled) == 1 and 10 <= signalled[0] < 20, signalled
    # The step in progress when the notice came, and at most one more (the agreement), are saved.
    assert [int(s) for s in stopped] == [signalled[0] + 1]
    assert out["resumed_from_step"] == signalled[0] + 1
    assert_complete_checkpoints(run_dir)
    want = torch.load(Path(baseline[1].outputs["checkpoints"][-1]) / "model.pt", weights_only=True)
    got = torch.load(Path(out["checkpoints"][-1]) / "model.pt", weights_only=True)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=k)
