"""`--plan` after a crash: a stage with partial output says so, and train says where it resumes.

The train case reads a checkpoint-manager snapshot written with Ray Train's own schema
(`_CheckpointManagerState`), the file Ray Train V2 restores from, not a copy of our reader.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from contextlib import contextmanager

import pytest

from pipeline import storage
from pipeline.config import load_config
from pipeline.stage import Stage, StageResult
from pipeline.train import checkpoint as train_checkpoint
from pipeline.train import resume
from workflows import runner

WHEN = time.mktime((2026, 1, 2, 3, 4, 5, 0, 0, -1))  # local time 2026-01-02T03:04:05


class _NoTracking:
    class _Run:
        run_id = tracking_uri = None

        def log_metrics(self, *a, **k): pass
        def log_text(self, *a, **k): pass

    parent = _Run()

    @contextmanager
    def stage_run(self, *a, **k):
        yield self._Run()


@pytest.fixture
def no_tracking():
    return _NoTracking()


@pytest.fixture
def fake_stages(monkeypatch):
    def fake_load(stage):
        def body(ctx):
            storage.write_text(storage.join(ctx.out_dir, "out.txt"), ctx.name)
            return StageResult()
        return body

    monkeypatch.setattr(Stage, "load", fake_load)


def cfg_for(tmp_path):
    return load_config(None, [f"--run.work_dir={tmp_path}", "--tracking.enabled=false"])


def reasons(cfg) -> dict[str, str]:
    return {p.stage.name: p.reason for p in runner.make_plan(cfg)}


def run_to(cfg, to: str, tracking) -> None:
    runner.execute(cfg, runner.make_plan(cfg, to=to), tracking)


def touch_tree(path, when: float) -> None:
    for root, dirs, files in os.walk(path):
        for name in files + dirs:
            os.utime(os.path.join(root, name), (when, when))
    os.utime(path, (when, when))


def test_interrupted_encode_is_named_with_the_time_of_its_partial_output(tmp_path, fake_stages, no_tracking):
    cfg = cfg_for(tmp_path)
    run_to(cfg, "vocab", no_tracking)
    assert reasons(cfg)["encode"] == "never ran with this config"
    encode = {p.stage.name: p for p in runner.make_plan(cfg)}["encode"]
    storage.write_text(storage.join(encode.out_dir, "train", "shard-00000.parquet.tmp"), "half")  # killed here
    touch_tree(encode.out_dir, WHEN)
    r = reasons(cfg)
    assert r["encode"] == "interrupted (partial output from 2026-01-02T03:04:05, will rerun)"
    assert r["train"] == "never ran with this config"  # its own folder is absent


def write_snapshot(run_dir, steps: list[int]) -> None:
    """What Ray Train V2 keeps after `ray.train.report(checkpoint=...)` at each of `steps`."""
    from ray.train.v2._internal.execution.checkpoint.checkpoint_manager import (
        _CheckpointManagerState, _TrainingResultState)

    run_dir.mkdir(parents=True, exist_ok=True)
    results = []
    for step in steps:
        name = train_checkpoint.checkpoint_dir_name(step)
        (run_dir / name).mkdir(parents=True)
        (run_dir / name / train_checkpoint.META_FILE).write_text(json.dumps({"step": step}))
        results.append(_TrainingResultState(checkpoint_dir_name=name, metrics={"step": step}))
    state = _CheckpointManagerState(
        checkpoint_results=results, checkpoint_report_indices=list(range(len(results))),
        latest_checkpoint_result=results[-1] if results else None, pending_training_results=[],
        pending_validation_specs=[], current_report_index=len(results), validated_checkpoint_dir_names=[],
        timed_out_validation_checkpoint_dir_names=[], failed_validation_checkpoint_dir_names=[])
    with warnings.catch_warnings():  # Ray 2.60 writes it with pydantic's deprecated .json()
        warnings.simplefilter("ignore", DeprecationWarning)
        (run_dir / resume.SNAPSHOT).write_text(state.json())


def test_interrupted_train_says_from_which_checkpoint_it_resumes(tmp_path, fake_stages, no_tracking):
    cfg = cfg_for(tmp_path)
    run_to(cfg, "encode", no_tracking)
    key = runner.compute_keys(cfg)["train"]
    run_dir = tmp_path / "ray_train" / key
    write_snapshot(run_dir, [10, 20])
    touch_tree(run_dir, WHEN)
    assert reasons(cfg)["train"] == ("interrupted (partial output from 2026-01-02T03:04:05), "
                                     "will resume from step 20 (checkpoint checkpoint_0000020)")
    assert resume.META_FILE == train_checkpoint.META_FILE


def test_a_train_run_without_a_registered_checkpoint_starts_over(tmp_path, fake_stages, no_tracking):
    cfg = cfg_for(tmp_path)
    run_to(cfg, "encode", no_tracking)
    run_dir = tmp_path / "ray_train" / runner.compute_keys(cfg)["train"]
    write_snapshot(run_dir, [])
    touch_tree(run_dir, WHEN)
    assert reasons(cfg)["train"] == ("interrupted (partial output from 2026-01-02T03:04:05), "
                                     "will start from step 0 (no checkpoint was registered)")


def test_forced_train_is_reported_as_forced_not_resumed(tmp_path, fake_stages, no_tracking):
    cfg = cfg_for(tmp_path)
    run_to(cfg, "encode", no_tracking)
    write_snapshot(tmp_path / "ray_train" / runner.compute_keys(cfg)["train"], [10])
    plans = {p.stage.name: p for p in runner.make_plan(cfg, force=("train",))}
    assert plans["train"].reason == "forced (--force train)" and plans["train"].forced


def test_plan_while_another_driver_holds_the_work_dir(tmp_path, fake_stages, no_tracking):
    """`--plan` during a run: a stage with partial output may be the one running, not a crash."""
    import socket

    from workflows.lock import WorkDirLock

    cfg = cfg_for(tmp_path)
    run_to(cfg, "vocab", no_tracking)
    encode = {p.stage.name: p for p in runner.make_plan(cfg)}["encode"]
    storage.write_text(storage.join(encode.out_dir, "part.tmp"), "half")
    touch_tree(encode.out_dir, WHEN)
    assert WorkDirLock(str(tmp_path)).holder() is None
    with WorkDirLock(str(tmp_path)):
        busy = WorkDirLock(str(tmp_path)).holder()
        assert busy == f"{socket.gethostname()} pid {os.getpid()}"
        plans = {p.stage.name: p for p in runner.make_plan(cfg, busy=busy)}
    assert plans["encode"].reason == (f"unfinished (output from 2026-01-02T03:04:05); the work dir is in use by "
                                      f"{busy}, which may be running it")
    assert plans["train"].reason == "never ran with this config"
    assert WorkDirLock(str(tmp_path)).holder() is None  # released
