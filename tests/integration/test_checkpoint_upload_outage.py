"""The object store drops, then refuses, connections while a checkpoint is being uploaded: the
upload waits (retries with backoff, `pipeline.train.upload`), the run finishes, and every
checkpoint Ray Train registered is complete.

The `train` stage runs in a driver subprocess with its own local Ray, its bucket behind a proxy
(tests/support/flaky_proxy.py) in front of the suite's S3 server; the test reads the bucket
directly. A session wrapper (`tests/support/faults.py:gate`) holds the worker at step 15 until
checkpoint 10 is registered, so the outage starts between two checkpoints and catches the upload of
checkpoint 20 (asynchronous: the loop goes on meanwhile).
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pipeline import storage
from tests.support.faults import gate_env, set_gate
from tests.support.flaky_proxy import FlakyProxy
from tests.support.procs import wait_for
from tests.support.s3 import s3, s3_module  # noqa: F401 (fixtures)
from tests.support.synthetic import write_reverse_task

# The bound on each test (pytest-timeout): a driver run of ~1-2 min, waited up to 300 s.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]
MAX_STEPS, INTERVAL, VOCAB, RUN = 30, 10, 48, "upload-outage"

DRIVER = r"""
import json, sys
import ray
from pipeline.train import driver as train
from pipeline.config import load_config
from pipeline.stage import Manifest, StageContext

overrides, out_dir, shards, run = json.loads(sys.argv[1]), *sys.argv[2:5]
cfg = load_config(None, overrides)
vocab = {"vocab_size": %(vocab)d, "pad_id": 0, "unk_id": 1, "bos_id": 2, "eos_id": 3}
inputs = {"encode": Manifest(stage="encode", key="k", dir="", outputs={"splits": {"train": {"dir": shards}}}),
          "vocab": Manifest(stage="vocab", key="k", dir="", outputs=vocab)}
result = train.run(StageContext(name="train", key=run, cfg=cfg, out_dir=out_dir, inputs=inputs))  # starts its own local Ray
print("RESULT " + json.dumps({"outputs": result.outputs,
                              "session_dir": ray._private.worker._global_node.get_session_dir_path()}))
""" % {"vocab": VOCAB}


def registered(s3) -> list[int]:
    """Steps of the checkpoints in Ray Train's snapshot (read from the store, not through the proxy)."""
    key = f"wd-upload/ray_train/{RUN}/checkpoint_manager_snapshot.json"
    try:
        snapshot = s3.client().get_object(Bucket=s3.bucket, Key=key)["Body"].read()
    except s3.client().exceptions.NoSuchKey:
        return []
    return sorted({int(s) for s in re.findall(r"checkpoint_(\d+)", snapshot.decode())})


def test_a_store_outage_during_an_upload_delays_it_and_registers_complete_checkpoints(s3, tmp_path, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    shards = s3.uri("upload-data/train")
    storage.upload(write_reverse_task(tmp_path / "shards", num_rows=300, vocab_size=VOCAB, num_shards=2), shards)
    proxy = FlakyProxy(int(s3.endpoint.rsplit(":", 1)[1]))
    gate, log = tmp_path / "gate", tmp_path / "driver.log"
    set_gate(gate, 15)
    overrides = [f"--run.work_dir={s3.uri('wd-upload')}", "--workers.num_workers=1", "--workers.cpus_per_worker=1",
                 "--workers.use_gpu=false", "--speed.precision=fp32", "--model.d_model=32", "--model.d_ff=64",
                 "--model.n_heads=2", "--model.n_encoder_layers=1", "--model.n_decoder_layers=1",
                 "--model.max_positions=64", "--train.max_len=32", f"--train.max_steps={MAX_STEPS}",
                 "--train.warmup_steps=10", "--train.tokens_per_step=300", "--speed.max_tokens_per_batch=300",
                 f"--checkpoint.interval_steps={INTERVAL}", f"--metrics.log_interval_steps={INTERVAL}",
                 "--metrics.val_loss_interval_steps=1000", "--checkpoint.upload=async",
                 "--checkpoint.upload_retry_s=120", "--workers.max_failures=0"]
    env = {**os.environ, **gate_env(gate), "AWS_ENDPOINT_URL": proxy.endpoint}
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, json.dumps(overrides), s3.uri(f"wd-upload/train/{RUN}"),
                               shards, RUN], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=open(log, "w"),
                              text=True)
    try:
        wait_for("checkpoint 10 registered", lambda: registered(s3) == [10], driver, log, timeout_s=240)
        proxy.mode = "drop"  # requests cut off after 16 KiB: the checkpoint files are larger
        set_gate(gate, MAX_STEPS)
        wait_for("the upload of checkpoint 20 tried", lambda: proxy.resets >= 2, driver, log, timeout_s=240)
        time.sleep(3)
        proxy.mode = "refuse"
        time.sleep(4)
        assert registered(s3) == [10], "a checkpoint was registered while the store took no writes"
        proxy.mode = "pass"
        out, _ = driver.communicate(timeout=300)
    finally:
        if driver.poll() is None:
            driver.kill()
        proxy.close()
    text = log.read_text(errors="replace")
    assert driver.returncode == 0, text[-4000:]
    result = json.loads(out.split("RESULT ", 1)[1].splitlines()[0])  # Ray may print after it
    assert result["outputs"]["final_step"] == MAX_STEPS
    assert registered(s3) == [10, 20, 30]

    # Every registered checkpoint is complete in the bucket (read with boto3): three files, the
    # model loads, meta.json names its step.
    for step in registered(s3):
        prefix = f"wd-upload/ray_train/{RUN}/checkpoint_{step:07d}/"
        assert {k[len(prefix):] for k in s3.keys(prefix)} >= {"model.pt", "train_state.pt", "meta.json"}
        body = s3.client().get_object(Bucket=s3.bucket, Key=prefix + "model.pt")["Body"].read()
        assert torch.load(io.BytesIO(body), weights_only=True)
        meta = json.loads(s3.client().get_object(Bucket=s3.bucket, Key=prefix + "meta.json")["Body"].read())
        assert meta["step"] == step

    logs = text + "\n".join(p.read_text(errors="replace") for p in Path(result["session_dir"], "logs").rglob("*")
                            if p.is_file() and p.suffix in (".out", ".err", ".log"))
    assert re.search(r"checkpoint upload: checkpoint_0000020 to \S+ failed \(attempt 1: ", logs)
    assert re.search(r"checkpoint upload: checkpoint_0000020 to \S+ complete after \d+ attempts", logs)
