"""MLflow records of a workflow: a parent run, a nested run per stage, cached stages marked."""

from __future__ import annotations

import pytest

from pipeline import storage
from pipeline.config import load_config
from pipeline.stage import Stage, StageResult
from pipeline.tracking import Tracking
from workflows import runner


@pytest.fixture
def fake_stages(monkeypatch):
    def fake_load(stage):
        def body(ctx):
            storage.write_text(storage.join(ctx.out_dir, "out.txt"), ctx.name)
            return StageResult(outputs={}, metrics={f"{ctx.name}/rows": 3.0})
        return body

    monkeypatch.setattr(Stage, "load", fake_load)


def invocation(cfg):
    tracking = Tracking(cfg)
    with tracking.parent_run({"test": "1"}) as parent:
        runner.execute(cfg, runner.make_plan(cfg), tracking)
    return tracking, parent.run_id


@pytest.mark.slow
def test_parent_and_nested_stage_runs_in_the_sqlite_store(tmp_path, fake_stages):
    from mlflow import MlflowClient

    cfg = load_config(None, [f"--run.work_dir={tmp_path}"])
    tracking, first = invocation(cfg)
    assert tracking.uri == f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(tracking.uri)
    parent = client.get_run(first)
    assert parent.info.status == "FINISHED"
    assert parent.data.params["train.max_steps"] == "100000"
    assert parent.data.metrics["prepare/rows"] == 3.0
    assert parent.data.tags["cache_key.score"] == runner.compute_keys(cfg)["score"]
    exp = parent.info.experiment_id
    children = client.search_runs([exp], f"tags.mlflow.parentRunId = '{first}'")
    assert sorted(r.data.tags["stage"] for r in children) == sorted(runner.ORDER)
    assert {r.data.tags["cached"] for r in children} == {"false"}
    arts = [a.path for a in client.list_artifacts(children[0].info.run_id)]
    assert "manifest.json" in arts

    _, second = invocation(cfg)  # everything cached now: recorded as such
    children = client.search_runs([exp], f"tags.mlflow.parentRunId = '{second}'")
    assert {r.data.tags["cached"] for r in children} == {"true"}
    assert all(r.data.tags["cache_key"] == runner.compute_keys(cfg)[r.data.tags["stage"]] for r in children)
    producers = {r.data.tags["stage"]: r.info.run_id
                 for r in client.search_runs([exp], f"tags.mlflow.parentRunId = '{first}'")}
    assert {r.data.tags["stage"]: r.data.tags["source_run_id"] for r in children} == producers
    assert client.get_run(second).data.tags["stage_run.score"] == producers["score"]


def test_unreachable_tracking_server_fails_fast(tmp_path):
    from tests.support.procs import free_port

    cfg = load_config(None, [f"--run.work_dir={tmp_path}", f"--tracking.uri=http://127.0.0.1:{free_port()}"])
    with pytest.raises(ConnectionError, match="not reachable"):
        with Tracking(cfg).parent_run({}):
            pass


@pytest.fixture
def abandoned():
    """Enter a run's context and never leave it: what a driver killed with -9 leaves behind.
    The contexts are kept alive (a collected generator would end its run) and closed after."""
    held = []

    def enter(cm):
        held.append(cm)
        return cm.__enter__()

    yield enter
    for cm in reversed(held):
        cm.gen.close()


@pytest.mark.slow
def test_a_dead_drivers_runs_end_killed_and_its_stage_run_is_continued(tmp_path, abandoned):
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    cfg = load_config(None, [f"--run.work_dir={tmp_path / 'work'}", f"--tracking.uri={uri}"])
    other = load_config(None, [f"--run.work_dir={tmp_path / 'other'}", f"--tracking.uri={uri}"])
    dead = Tracking(cfg)
    dead_parent = abandoned(dead.parent_run({}))
    train = abandoned(dead.stage_run("train", "k1", cached=False, params={"a": 1}))
    for step in (1, 2, 3, 4, 5):
        train.log_metrics({"train/loss": 10.0 - step}, step=step)
    alive = Tracking(other)  # another work dir's driver, still running: not ours to end
    alive_parent = abandoned(alive.parent_run({}))

    new = Tracking(cfg)
    assert sorted(new.end_dead_runs()) == sorted([dead_parent.run_id, train.run_id])
    client = MlflowClient(uri)
    for run_id in (dead_parent.run_id, train.run_id):
        run = client.get_run(run_id)
        assert run.info.status == "KILLED"
        assert "died without ending it" in run.data.tags["end_reason"]
    assert client.get_run(alive_parent.run_id).info.status == "RUNNING"

    with new.parent_run({}) as parent:
        with new.stage_run("train", "k1", cached=False, params={"a": 1}) as t:
            assert t.run_id == train.run_id  # the same run, continued
            assert client.get_run(t.run_id).info.status == "RUNNING"
            for step in (3, 4, 5, 6, 7, 8):  # resumed from a checkpoint at step 2: 3..5 replayed
                t.log_metrics({"train/loss": 10.0 - step}, step=step)
        with new.stage_run("average", "k2", cached=False, params={}) as avg:
            pass
    history = client.get_metric_history(train.run_id, "train/loss")
    assert sorted(m.step for m in history) == [1, 2, 3, 4, 5, 6, 7, 8]
    assert {m.step: m.value for m in history} == {s: 10.0 - s for s in range(1, 9)}
    run = client.get_run(train.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags["mlflow.parentRunId"] == parent.run_id
    assert run.data.tags["attempts"] == "2" and run.data.tags["parent_run.1"] == dead_parent.run_id
    assert client.get_run(parent.run_id).data.tags["stage_run.train"] == train.run_id
    assert avg.run_id != train.run_id

    with new.parent_run({}):  # --force: the work restarts from scratch, so does its run
        with new.stage_run("train", "k1", cached=False, params={"a": 1}, fresh=True) as forced:
            assert forced.run_id != train.run_id
