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


def test_unreachable_tracking_server_fails_fast(tmp_path):
    from tests.support.procs import free_port

    cfg = load_config(None, [f"--run.work_dir={tmp_path}", f"--tracking.uri=http://127.0.0.1:{free_port()}"])
    with pytest.raises(ConnectionError, match="not reachable"):
        with Tracking(cfg).parent_run({}):
            pass
