"""kill -9 the driver mid-encode, then mid-train; rerun; what MLflow and `--plan` say must be true.

Each driver is `workflows/reproduce_base.py` in its own process session (its own local Ray), killed
by process id. Toy sizes: 300 pairs of each corpus of the synthetic mirror (tests/support/synthetic_mirror.py:
the point is the kills and the resume, not the text), a 1+1-layer d_model=32 model, 24 steps.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.config import load_config
from pipeline.tracking import SPOOL_FOLDER, MetricSpool
from pipeline.train.resume import SNAPSHOT
from tests.support import faults
from tests.support.procs import session_pids, stop
from workflows import reproduce_base, runner

# The bound on each test (pytest-timeout): three drivers on the DAG, each waited up to 300 s.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
TOY = [
    "--data.corpora=",  # the mirror's three corpora
    "--data.max_pairs_per_corpus=300", "--data.num_shards=2", "--vocab.size=300", "--vocab.sample_sentences=1000",
    "--model.d_model=32", "--model.d_ff=64", "--model.n_heads=2", "--model.n_encoder_layers=1",
    "--model.n_decoder_layers=1", "--model.max_positions=256",
    "--train.max_steps=24", "--train.warmup_steps=8", "--train.tokens_per_step=1500",
    "--speed.max_tokens_per_batch=1500", "--checkpoint.interval_steps=8",
    "--metrics.val_loss_interval_steps=12", "--metrics.log_interval_steps=4", "--checkpoint.num_to_keep=2",
    "--average.checkpoints=2", "--speed.precision=fp32",  # the same steps on every CPU class
    # no dev-BLEU task per checkpoint: dev BLEU while training is test_dev_bleu.py's; here, the
    # kills and the resume
    "--dev_bleu.enabled=false",
]
STAMP = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d"


def driver(args: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "workflows/reproduce_base.py", "--config", "configs/local.toml", *args]
    return subprocess.Popen(cmd, cwd=REPO, stdout=open(log, "ab"), stderr=subprocess.STDOUT,
                            start_new_session=True, env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})


def kill_when(proc: subprocess.Popen, ready, what: str, timeout_s: float = 300, before_kill=None) -> None:
    """SIGKILL the driver (by pid) as soon as `ready()`; then what is left of its session."""
    try:
        deadline = time.monotonic() + timeout_s
        while not ready() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ready(), f"the driver never reached {what} (exit code {proc.poll()})"
        if before_kill is not None:
            before_kill()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        # Its Ray agents would linger ~60 s (README, "After a crash"): no reason to wait for them.
        for pid in session_pids(proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        stop(proc, timeout_s=10)


def plan(args: list[str], capsys) -> dict[str, tuple[str, str]]:
    assert reproduce_base.main(["--config", "configs/local.toml", *args, "--plan"]) == 0
    rows = [line.split(None, 3) for line in capsys.readouterr().out.splitlines()]
    return {r[0]: (r[2], r[3]) for r in rows if len(r) == 4 and r[0] in runner.ORDER}


def test_killed_driver_mid_encode_and_mid_train(tmp_path, synthetic_mirror, capsys, monkeypatch):
    from mlflow import MlflowClient

    monkeypatch.chdir(REPO)
    work = tmp_path / "work"
    args = [f"--run.work_dir={work}", f"--data.mirror={synthetic_mirror}", *TOY, "--to", "train"]
    keys = runner.compute_keys(load_config("configs/local.toml", args[:-2]))
    encode_dir, train_run = work / "encode" / keys["encode"], work / "ray_train" / keys["train"]

    # 1. Killed while encoding: the runner made the stage's folder, the manifest is not written.
    kill_when(driver(args, tmp_path / "driver1.log"), encode_dir.exists, "encode")
    assert not (encode_dir / "_manifest.json").exists()
    p = plan(args, capsys)
    assert p["vocab"][0] == "cached"
    assert p["encode"][0] == "run" and re.fullmatch(rf"interrupted \(partial output from {STAMP}, will rerun\)",
                                                    p["encode"][1]), p["encode"]
    assert p["train"] == ("run", "never ran with this config")

    # 2. Encode reruns; a worker hangs before step 23 (test hook) after checkpoint 16 is registered.
    marker = tmp_path / "hung"

    def at_step_23() -> bool:
        snapshot = train_run / SNAPSHOT
        return marker.exists() and snapshot.exists() and "checkpoint_0000016" in snapshot.read_text()

    def plan_while_running() -> None:  # the hung driver still holds the work dir: not "interrupted"
        reason = plan(args, capsys)["train"][1]
        assert reason.startswith("unfinished (output from ") and "which may be running it" in reason, reason

    proc = driver(args, tmp_path / "driver2.log", faults.env(23, marker, "hang"))
    kill_when(proc, at_step_23, "step 23", before_kill=plan_while_running)
    p = plan(args, capsys)
    assert p["encode"][0] == "cached"
    assert p["train"][0] == "run" and re.fullmatch(
        rf"interrupted \(partial output from {STAMP}\), will resume from step 16 \(checkpoint checkpoint_0000016\)",
        p["train"][1]), p["train"]

    # 3. A third driver finishes; it finds the two dead drivers' runs still RUNNING and ends them.
    proc = driver(args, tmp_path / "driver3.log")
    try:
        assert proc.wait(timeout=300) == 0, (tmp_path / "driver3.log").read_text()[-3000:]
    finally:
        stop(proc, timeout_s=10)

    client = MlflowClient(f"sqlite:///{work}/mlflow.db")
    exp = client.get_experiment_by_name("transformer-wmt14-ende").experiment_id
    runs = client.search_runs([exp], "", max_results=1000)
    assert [r.info.run_name for r in runs if r.info.status == "RUNNING"] == []
    parents = sorted((r for r in runs if "stage" not in r.data.tags), key=lambda r: r.info.start_time)
    assert [r.info.status for r in parents] == ["KILLED", "KILLED", "FINISHED"]
    assert all("died without ending it" in r.data.tags["end_reason"] for r in parents[:2])

    def work_runs(stage: str) -> list:
        return [r for r in runs if r.data.tags.get("stage") == stage and r.data.tags["cached"] == "false"]

    (encode,) = work_runs("encode")  # driver 1's, continued by driver 2
    assert encode.info.status == "FINISHED" and encode.data.tags["attempts"] == "2"
    (train,) = work_runs("train")  # driver 2's, continued by driver 3: one curve
    assert train.info.status == "FINISHED" and train.data.tags["attempts"] == "2"
    assert train.data.tags["mlflow.parentRunId"] == parents[2].info.run_id
    assert parents[2].data.tags["stage_run.train"] == train.info.run_id
    # Driver 2 logged steps 4..20 (those up to its checkpoint at 16 delivered, or spooled then if
    # its killed worker had not delivered them yet); driver 3 resumed at 16 and replayed 17..20:
    # each step once, and no spool file left.
    for key, steps in (("train/loss", [4, 8, 12, 16, 20, 24]), ("val/loss", [12, 24])):
        assert sorted(m.step for m in client.get_metric_history(train.info.run_id, key)) == steps, key
    assert not MetricSpool(str(work / "ray_train" / SPOOL_FOLDER), train.info.run_id).files()
