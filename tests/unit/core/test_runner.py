"""The runner's cache: keys, plans, reruns and stale detection, over fake stage bodies.

The fake stages write a file whose content depends on their inputs, so a stale or skipped
rerun would show up in what downstream stages read.
"""

from __future__ import annotations

import pytest

from pipeline import storage
from pipeline.config import load_config
from pipeline.dag import ORDER
from pipeline.stage import MANIFEST, NotImplementedStage, Stage, StageResult
from workflows import runner
from workflows.lock import WorkDirBusy, WorkDirLock


class NoTracking:
    class _T:
        run_id = None
        tracking_uri = None

        def log_metrics(self, *a, **k): pass
        def log_text(self, *a, **k): pass

    parent = _T()

    from contextlib import contextmanager

    @contextmanager
    def stage_run(self, *a, **k):
        yield self._T()


@pytest.fixture
def calls(monkeypatch):
    """Replace every stage body by a fake one; returns the list of stages that ran."""
    ran: list[str] = []

    def fake_load(stage: Stage):
        def body(ctx):
            ran.append(ctx.name)
            seen = "|".join(storage.read_text(storage.join(ctx.inputs[u].dir, "out.txt"))
                            for u in stage.upstream)
            storage.write_text(storage.join(ctx.out_dir, "out.txt"), f"{ctx.name}({seen})#{len(ran)}")
            return StageResult(outputs={"n": len(ran)}, metrics={f"{ctx.name}/n": len(ran)})
        return body

    monkeypatch.setattr(Stage, "load", fake_load)
    return ran


def cfg_for(tmp_path, *overrides):
    return load_config(None, [f"--run.work_dir={tmp_path}", "--tracking.enabled=false", *overrides])


def run_all(cfg, **kw):
    plans = runner.make_plan(cfg, **kw)
    runner.execute(cfg, plans, NoTracking())
    return {p.stage.name: p.action for p in plans}


def test_first_run_runs_everything_second_is_all_cached(tmp_path, calls):
    cfg = cfg_for(tmp_path)
    assert set(run_all(cfg).values()) == {"run"}
    assert calls == ORDER
    actions = run_all(cfg)
    assert set(actions.values()) == {"cached"} and calls == ORDER  # nothing ran again


def test_changing_a_value_reruns_exactly_the_stages_that_read_it(tmp_path, calls):
    run_all(cfg_for(tmp_path))
    calls.clear()
    cfg = cfg_for(tmp_path, "--vocab.size=8000")
    plans = runner.make_plan(cfg)
    assert "vocab.size: 37000 -> 8000" in {p.stage.name: p.reason for p in plans}["vocab"]
    runner.execute(cfg, plans, NoTracking())
    assert calls == ["vocab", "encode", "train", "average", "export", "translate", "score", "register"]


def test_operational_values_change_nothing(tmp_path, calls):
    run_all(cfg_for(tmp_path))
    actions = run_all(cfg_for(tmp_path, "--workers.num_workers=2", "--decode.batch_tokens=99"))
    assert set(actions.values()) == {"cached"}


def test_force_reruns_the_stage_and_what_depends_on_it(tmp_path, calls):
    run_all(cfg_for(tmp_path))
    calls.clear()
    run_all(cfg_for(tmp_path), force=("translate",))
    assert calls == ["translate", "score", "register"]


def test_only_reruns_one_stage_and_downstream_becomes_stale(tmp_path, calls):
    run_all(cfg_for(tmp_path))
    calls.clear()
    run_all(cfg_for(tmp_path), only="translate")
    assert calls == ["translate"]
    plans = runner.make_plan(cfg_for(tmp_path))
    assert {p.stage.name: p.action for p in plans}["score"] == "run"
    assert "stale" in {p.stage.name: p.reason for p in plans}["score"]


def test_only_without_cached_inputs_is_a_clear_error(tmp_path, calls):
    with pytest.raises(runner.PlanError, match="stage 'prepare' has no usable cached output"):
        runner.make_plan(cfg_for(tmp_path), only="encode")
    assert calls == []


def test_a_half_written_stage_is_not_done(tmp_path, calls):
    cfg = cfg_for(tmp_path)
    run_all(cfg)
    plans = {p.stage.name: p for p in runner.make_plan(cfg)}
    storage.rmtree(storage.join(plans["average"].out_dir, MANIFEST))  # as if killed before the end
    calls.clear()
    run_all(cfg)
    assert calls == ["average", "export", "translate", "score", "register"]


def test_unknown_stage_and_missing_implementation(tmp_path, monkeypatch):
    with pytest.raises(runner.PlanError, match="unknown stage 'trian'"):
        runner.make_plan(cfg_for(tmp_path), only="trian")
    stage = Stage(name="x", version="1", reads=(), upstream=(), impl="pipeline.does_not_exist:run")
    with pytest.raises(NotImplementedStage, match="not implemented"):
        stage.load()


def test_second_driver_on_the_same_work_dir_is_refused(tmp_path):
    with WorkDirLock(str(tmp_path)):
        with pytest.raises(WorkDirBusy, match="in use"):
            with WorkDirLock(str(tmp_path)):
                pass
    with WorkDirLock(str(tmp_path)):  # released on exit
        pass


def test_to_stops_after_the_named_stage(tmp_path, calls):
    actions = run_all(cfg_for(tmp_path), to="encode")
    assert calls == ["download", "prepare", "vocab", "encode"]
    assert actions["train"] == "skip"


def test_force_on_a_resumable_stage_starts_it_from_scratch(tmp_path, calls):
    cfg = cfg_for(tmp_path)
    run_all(cfg)
    train_dir = {p.stage.name: p for p in runner.make_plan(cfg)}["train"].out_dir
    storage.write_text(storage.join(train_dir, "left_from_before.txt"), "x")
    run_all(cfg, force=("train",))
    assert not storage.exists(storage.join(train_dir, "left_from_before.txt"))
