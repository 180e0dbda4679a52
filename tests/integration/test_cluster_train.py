"""Ray Train over two nodes with checkpoints on an object store, surviving the loss of a node.

Two Ray nodes on this machine (a head with `node_a`, a worker with `node_b`, one CPU each; the
workers are placed STRICT_SPREAD, one per node), the real `train` stage (`pipeline.train.driver.run`) on
synthetic shards in the S3 bucket. Once Ray Train has registered a checkpoint, the second node is
killed and a replacement joins: the run goes on from its latest checkpoint (FailureConfig), so no
more than one checkpoint interval of work is lost.

The driver runs in a subprocess so that this test's Ray connection never mixes with a Ray that
other tests of the session started in the pytest process.

Extended tier (`make test-extended`, not CI): CI's tests/integration/test_cluster_elastic.py kills
the same node of the same two-node cluster, its work dir and checkpoints on the same S3 server, and
checks the resume from the checkpoint registered before the kill step for step; what only this test
adds is a fixed-size group (num_workers = 2, STRICT_SPREAD) waiting for a replacement node.
"""

from __future__ import annotations

import json
import re
import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline import storage
from tests.integration.test_cluster_elastic import registered_step  # Ray Train's snapshot, read from S3
from tests.support.procs import RayHead, stop
from tests.support.s3 import s3, s3_module  # noqa: F401 (fixtures)
from tests.support.synthetic import write_reverse_task

REPO = Path(__file__).resolve().parents[2]
MAX_STEPS, INTERVAL = 50, 10
VOCAB = 48
RUN = "two-nodes"  # the Ray Train run's name (train.run names it after the stage key)

DRIVER = r"""
import json, sys
import ray
from ray.util.state import list_actors
from pipeline.train import driver as train
from pipeline.config import load_config
from pipeline.stage import Manifest, StageContext

overrides, out_dir, shards, repo, run = json.loads(sys.argv[1]), *sys.argv[2:6]
cfg = load_config(None, overrides)
ray.init(address=cfg.run.ray_address, runtime_env={"env_vars": {"PYTHONPATH": repo}}, log_to_driver=False)
vocab = {"vocab_size": %(vocab)d, "pad_id": 0, "unk_id": 1, "bos_id": 2, "eos_id": 3}
inputs = {"encode": Manifest(stage="encode", key="k", dir="", outputs={"splits": {"train": {"dir": shards}}}),
          "vocab": Manifest(stage="vocab", key="k", dir="", outputs=vocab)}
result = train.run(StageContext(name="train", key=run, cfg=cfg, out_dir=out_dir, inputs=inputs))
nodes = {n["NodeID"]: sorted(k for k in n["Resources"] if k.startswith("node_")) for n in ray.nodes()}
workers = list_actors(address=cfg.run.ray_address, filters=[("class_name", "=", "RayTrainWorker")], detail=True,
                      limit=100)
print("RESULT " + json.dumps({
    "outputs": result.outputs,
    "worker_nodes": sorted(sum((nodes.get(a.node_id, []) for a in workers), [])),
    "num_workers_started": len(workers),
}))
""" % {"vocab": VOCAB}


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.timeout(900)  # a checkpoint waited up to 240 s, then the driver up to 360 s
def test_two_node_training_survives_losing_a_node(s3, tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_AUTH_TOKEN", secrets.token_hex(32))
    shards = s3.uri("train-data/train")
    storage.upload(write_reverse_task(tmp_path / "shards", num_rows=400, vocab_size=VOCAB, num_shards=2), shards)

    head = RayHead(tmp_path, num_cpus=1, resources='{"node_a": 1}')
    workers = [head.add_worker(num_cpus=1, resources='{"node_b": 1}', name="worker-b")]
    driver = None
    try:
        overrides = [f"--run.ray_address={head.address}", f"--run.work_dir={s3.uri('train-wd')}",
                     "--workers.num_workers=2", "--workers.placement_strategy=STRICT_SPREAD", "--workers.use_gpu=false", "--speed.precision=fp32",
                     "--model.d_model=32", "--model.d_ff=64", "--model.n_heads=2", "--model.n_encoder_layers=1",
                     "--model.n_decoder_layers=1", "--model.max_positions=64", "--train.max_len=32",
                     f"--train.max_steps={MAX_STEPS}", "--train.warmup_steps=10",
                     "--train.tokens_per_step=300", "--speed.max_tokens_per_batch=300",
                     f"--checkpoint.interval_steps={INTERVAL}", f"--metrics.log_interval_steps={INTERVAL}",
                     "--metrics.val_loss_interval_steps=1000", "--workers.max_failures=3"]
        driver = subprocess.Popen(
            [sys.executable, "-c", DRIVER, json.dumps(overrides), s3.uri(f"train-wd/train/{RUN}"), shards,
             str(REPO), RUN], cwd=REPO, stdout=subprocess.PIPE, stderr=open(tmp_path / "driver.log", "w"),
            text=True)

        deadline = time.time() + 240
        while (before_kill := registered_step(s3, "train-wd", RUN)) == 0:
            assert driver.poll() is None, (tmp_path / "driver.log").read_text()[-3000:]
            assert time.time() < deadline, "Ray Train registered no checkpoint in 240 s"
            time.sleep(0.3)
        assert before_kill < MAX_STEPS, "training ended before the node could be killed: raise MAX_STEPS"
        stop(workers[0], timeout_s=0)  # node_b dies mid-training (SIGKILL to its whole session)
        workers.append(head.add_worker(num_cpus=1, resources='{"node_b": 1}', name="worker-b2"))
        out, _ = driver.communicate(timeout=360)
    finally:
        if driver is not None and driver.poll() is None:
            driver.kill()
        for w in workers:
            stop(w, timeout_s=0)
        head.stop()
    log = (tmp_path / "driver.log").read_text()
    assert driver.returncode == 0, log[-4000:]
    result = json.loads(out.split("RESULT ", 1)[1].splitlines()[0])  # Ray may print after it
    outputs = result["outputs"]
    assert outputs["final_step"] == MAX_STEPS
    assert outputs["checkpoints"] and all(
        c.startswith(f"s3://{s3.bucket}/train-wd/ray_train/{RUN}/checkpoint_") for c in outputs["checkpoints"])
    assert registered_step(s3, "train-wd", RUN) == MAX_STEPS
    assert set(result["worker_nodes"]) == {"node_a", "node_b"}  # spread over both nodes
    assert result["num_workers_started"] >= 4  # a second worker group after the failure

    # The new workers started from the checkpoint registered before the kill (or a later one), not
    # from step 0: what was lost is the work since that checkpoint, less than one interval.
    logs = "\n".join(p.read_text(errors="replace") for p in head.logs.rglob("*")  # the head is stopped
                     if p.is_file() and p.name.startswith(("worker-", "ray-train-app-worker")))
    resumed = [int(s) for s in re.findall(r"resumed from checkpoint at step (\d+)", logs)]
    assert resumed and min(resumed) >= before_kill, (resumed, before_kill)
