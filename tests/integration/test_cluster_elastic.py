"""An elastic run (`workers.num_workers = [1, 2]`) over two nodes: it shrinks when a node is lost and
grows back when one joins, and trains the same model, step for step.

Two Ray nodes on this machine, one CPU each (a head with `node_a`, a worker with `node_b`), so each
worker of the group has a node of its own. The real `train` stage runs in a driver subprocess (its
Ray connection never mixes with the pytest process's), tracked to the suite's MLflow server, its
work dir and Ray Train's checkpoints on the suite's S3 server (as on a cluster), so the resumes
read their checkpoints back from the object store.
A session wrapper (`tests/support/faults.py:gate`) holds the workers before a step the test names,
so the cluster changes at known steps, with no race against the loop:

    steps 1-12 on 2 workers (checkpoint 10)  -> node_b's processes killed (its raylet and worker)
    steps 11-22 on 1 worker, from checkpoint 10 (checkpoint 20) -> a new node joins
    steps 21-40 on 2 workers, from checkpoint 20, after Ray Train's resize check

Model dropout is 0: the loop seeds dropout per (seed, rank, step), so at another world size the
same step draws other masks; everything else a step computes (its sentences, the loss normalized
by the step's target tokens, the lr) does not depend on the world size, so the losses must equal
an uninterrupted run's on one worker (in this process, no Ray) up to the order of the reductions.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.config import load_config
from pipeline.train.loop import LocalSession, LoopSpec, Trainer
from pipeline.models import model_config_for
from tests.support.faults import gate_env, set_gate
from tests.support.procs import RayHead, stop, wait_for
from tests.support.s3 import s3, s3_module  # noqa: F401 (fixtures)
from tests.support.synthetic import write_reverse_task

# The bound on each test (pytest-timeout): a two-node cluster, a lost node, a grow-back: ~3 min, drivers waited up to 360 s each.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

REPO = Path(__file__).resolve().parents[2]
MAX_STEPS, INTERVAL, VOCAB = 40, 10, 48

DRIVER = r"""
import json, sys
import ray
from pipeline.train import driver as train
from pipeline.config import load_config
from pipeline.stage import Manifest, StageContext
from pipeline.tracking import RunLogger

overrides, out_dir, shards, repo, run, uri, run_id = json.loads(sys.argv[1]), *sys.argv[2:8]
cfg = load_config(None, overrides)
ray.init(address=cfg.run.ray_address, log_to_driver=False,
         runtime_env={"env_vars": {"PYTHONPATH": repo},
                      "worker_process_setup_hook": "tests.support.faults.fast_cluster_view"})
vocab = {"vocab_size": %(vocab)d, "pad_id": 0, "unk_id": 1, "bos_id": 2, "eos_id": 3}
inputs = {"encode": Manifest(stage="encode", key="k", dir="", outputs={"splits": {"train": {"dir": shards}}}),
          "vocab": Manifest(stage="vocab", key="k", dir="", outputs=vocab)}
result = train.run(StageContext(name="train", key=run, cfg=cfg, out_dir=out_dir, inputs=inputs, tracker=RunLogger(uri, run_id)))
print("RESULT " + json.dumps({"outputs": result.outputs,
                              "session_dir": ray._private.worker._global_node.get_session_dir_path()}))
""" % {"vocab": VOCAB}


def config(head: RayHead, work_dir: str, workers: str) -> list[str]:
    return [f"--run.ray_address={head.address}", f"--run.work_dir={work_dir}", f"--workers.num_workers={workers}",
            "--workers.elastic_resize_interval_s=2", "--workers.cpus_per_worker=1", "--workers.use_gpu=false",
            "--speed.precision=fp32", "--model.d_model=32", "--model.d_ff=64", "--model.n_heads=2",
            "--model.n_encoder_layers=1", "--model.n_decoder_layers=1", "--model.max_positions=64",
            "--model.dropout=0", "--train.max_len=32", f"--train.max_steps={MAX_STEPS}", "--train.warmup_steps=10",
            "--train.tokens_per_step=300", "--speed.max_tokens_per_batch=200",
            f"--checkpoint.interval_steps={INTERVAL}", "--metrics.log_interval_steps=1",
            "--metrics.val_loss_interval_steps=1000", "--workers.max_failures=3"]


def start_driver(tmp: Path, overrides: list[str], run: str, shards: Path, uri: str, run_id: str,
                 env: dict[str, str] | None = None) -> subprocess.Popen:
    work_dir = overrides[1].split("=", 1)[1]
    return subprocess.Popen(
        [sys.executable, "-c", DRIVER, json.dumps(overrides), f"{work_dir}/train/{run}", str(shards), str(REPO), run,
         uri, run_id], cwd=REPO, stdout=subprocess.PIPE, stderr=open(tmp / f"driver-{run}.log", "w"), text=True,
        env={**os.environ, **(env or {})})


def finish(driver: subprocess.Popen, tmp: Path, run: str, timeout_s: float = 360) -> dict:
    out, _ = driver.communicate(timeout=timeout_s)
    assert driver.returncode == 0, (tmp / f"driver-{run}.log").read_text()[-4000:]
    return json.loads(out.split("RESULT ", 1)[1].splitlines()[0])  # Ray may print after it


def registered_step(s3, prefix: str, run: str) -> int:
    """The step of the latest checkpoint Ray Train has registered (0 = none yet): its controller
    rewrites checkpoint_manager_snapshot.json in the run's folder at each registration."""
    try:
        body = s3.client().get_object(Bucket=s3.bucket, Key=f"{prefix}/ray_train/{run}/checkpoint_manager_snapshot.json")
        snapshot = json.loads(body["Body"].read())
    except s3.client().exceptions.NoSuchKey:  # not yet
        return 0
    return max(map(int, re.findall(r"checkpoint_(\d+)", json.dumps(snapshot.get("latest_checkpoint_result")))),
               default=0)


def reference_losses(head: RayHead, work_dir: str, shards: Path, tmp: Path) -> list[tuple[int, float]]:
    """The uninterrupted reference: the same config on ONE worker, in this process (no Ray): a
    step's global batch does not depend on the world size, so neither do its losses."""
    cfg = load_config(None, config(head, work_dir, "1"))
    mc = model_config_for(cfg, {"vocab_size": VOCAB})
    spec = LoopSpec(cfg=cfg.to_dict(), model_config=mc.to_dict(), train_dir=str(shards))
    summary = Trainer(spec, LocalSession(tmp / "reference", device="cpu")).run()
    return [(int(h[0]), h[1]) for h in summary["history_train"]]


def history(client, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def test_elastic_run_shrinks_on_a_lost_node_grows_back_and_trains_the_same_model(s3, mlflow_uri, tmp_path,
                                                                                 monkeypatch):
    from mlflow import MlflowClient

    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_AUTH_TOKEN", secrets.token_hex(32))
    shards = write_reverse_task(tmp_path / "shards", num_rows=400, vocab_size=VOCAB, num_shards=2)
    # The GCS declares node_b dead after health_check_failure_threshold missed checks, one every
    # health_check_period_ms: 5 x 3 s by Ray's defaults, 5 x 1 s here (a 2 s timeout each, so a busy
    # 2-core machine does not lose a live node); until then Ray Train retries a 2-worker group.
    head = RayHead(tmp_path, num_cpus=1, resources='{"node_a": 1}',
                   env={"RAY_health_check_period_ms": "1000", "RAY_health_check_timeout_ms": "2000",
                        "RAY_health_check_failure_threshold": "5"})
    nodes = [head.add_worker(num_cpus=1, resources='{"node_b": 1}', name="worker-b")]
    drivers: list[subprocess.Popen] = []
    try:
        client = MlflowClient(mlflow_uri)
        run_id = client.create_run(client.create_experiment("elastic")).info.run_id
        work_dir = s3.uri("elastic-wd")
        gate, log = tmp_path / "gate", tmp_path / "driver-elastic.log"
        set_gate(gate, 12)
        # Until Ray declares node_b dead, Ray Train first retries two workers and waits out its
        # worker-group start timeout (60 s by default; README "On spot or preemptible nodes").
        driver = start_driver(tmp_path, config(head, work_dir, "1,2"), "elastic", shards, mlflow_uri, run_id,
                              env={**gate_env(gate), "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "10"})
        drivers.append(driver)
        registered = lambda: registered_step(s3, "elastic-wd", "elastic")  # noqa: E731
        wait_for("checkpoint 10 registered", lambda: registered() >= 10, driver, log)
        # Rank 0 may be on node_b: a SIGKILL takes the metrics its logger has not sent yet with it
        # (its first send imports MLflow: seconds on a busy 2-core machine). The kill comes once
        # the first group's points up to the checkpoint are in MLflow, so what this test counts is
        # the resize's logging, not that race.
        wait_for("the first group's metrics up to step 10 in MLflow",
                 lambda: history(client, run_id, "train/world_size")[:1] == [(0, 2.0)]
                 and max((s for s, _ in history(client, run_id, "train/loss")), default=0) >= 10, driver, log)
        stop(nodes[0], timeout_s=0)  # node_b is lost: SIGKILL to its raylet and its worker
        set_gate(gate, 22)
        wait_for("checkpoint 20 registered (on the worker left)", lambda: registered() >= 20,
                 driver, log)
        nodes.append(head.add_worker(num_cpus=1, resources='{"node_b": 1}', name="worker-b2"))
        wait_for("the group grown back to 2 workers", lambda: history(client, run_id, "train/world_size")[-1:] ==
                 [(20, 2.0)], driver, log)
        set_gate(gate, MAX_STEPS)
        result = finish(driver, tmp_path, "elastic")
        assert result["outputs"]["final_step"] == MAX_STEPS
        assert result["outputs"]["num_workers"] == 2
        # One point per (re)start, at the step it resumed from: 2 workers, then 1 after the loss of
        # node_b (from checkpoint 10), then 2 again after the resize (from checkpoint 20).
        assert history(client, run_id, "train/world_size") == [(0, 2.0), (10, 1.0), (20, 2.0)]
        accum = dict(history(client, run_id, "train/accum"))
        assert sorted(accum) == [0, 10, 20] and accum[10] >= accum[20]
        got = history(client, run_id, "train/loss")
        steps = [s for s, _ in got]
        assert steps == list(range(1, MAX_STEPS + 1)), "every step logged exactly once (replayed steps not again)"
        want = reference_losses(head, work_dir, shards, tmp_path)
        assert [s for s, _ in want] == steps
        assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-5)

        logs = "\n".join(p.read_text(errors="replace") for p in Path(result["session_dir"], "logs").rglob("*")
                         if p.is_file() and p.suffix in (".out", ".err", ".log"))
        assert re.search(r"elastic: resumed at step 10 on 1 worker\(s\), 2 at the checkpoint: the group shrank", logs)
        assert re.search(r"elastic: resumed at step 20 on 2 worker\(s\), 1 at the checkpoint: the group grew", logs)
        # Ray 2.60 charges a node lost without a drain notice to workers.max_failures (one worker-group
        # failure here); the resize back to 2 workers is no failure. Until Ray's health check marks the
        # node dead, the restart may also wait out the worker-group start timeout: a controller retry,
        # charged to no limit. README "On spot or preemptible nodes".
        decisions = set(re.findall(r"\[FailurePolicy\] (\w+)\s+Source: ([a-z ]+?)\s+Error count: (\d+) "
                                   r"\(max allowed: (\w+)\)", logs))
        assert {d for d in decisions if d[1] != "controller"} == {("RETRY", "worker group", "1", "3")}, decisions
        assert {d[3] for d in decisions if d[1] == "controller"} <= {"inf"}, decisions
    finally:
        for d in drivers:
            if d.poll() is None:
                d.kill()
        for n in nodes:
            stop(n, timeout_s=0)
        head.stop()
