"""The tracking server goes away mid-train and comes back: training never waits for it, and
when training ends before the server is back, the points it could not take are spooled and
delivered once it is (what the train stage's driver does): the whole curve, each step once.

The loop runs in-process (`LocalSession`, no Ray) and tracks to the suite's MLflow server
(`mlflow_uri`) through a proxy (tests/support/flaky_proxy.py) that the test switches to refuse:
from the loop's side the server is gone (every open connection reset, every new one refused after
connecting; MLflow's client retries both alike), while the test reads the server directly. MLflow's
HTTP retries are shortened (the env vars MLflow reads per request) so that the outage outlasts them,
as a real one of minutes outlasts the defaults. Step times are read from the server afterwards:
each point's timestamp is when the loop logged it.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from model import ModelConfig
from pipeline.config import Config
from pipeline.train.loop import LocalSession, LoopSpec, Trainer
from tests.support.flaky_proxy import FlakyProxy
from tests.support.synthetic import write_reverse_task

# The bound on each test (pytest-timeout): an outage of 12 s, a trainer joined within 120 s, the tracking buffer's close.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

VOCAB = 64
OUTAGE_S = 12.0  # > MLflow's retries below (1 + 2 + 4 s of backoff)


def spec_for(shards: Path, uri: str, run_id: str, max_steps: int, work_dir: Path) -> LoopSpec:
    cfg = Config()
    cfg.speed.precision = "fp32"  # the step-rate bounds below were measured in fp32, on every CPU class
    cfg.run.work_dir = str(work_dir)  # the spool: <work_dir>/ray_train/tracking_spool
    t = cfg.train
    t.max_steps, t.tokens_per_step, cfg.speed.max_tokens_per_batch, t.warmup_steps = max_steps, 400, 400, 8
    cfg.metrics.log_interval_steps, cfg.metrics.val_loss_interval_steps, cfg.checkpoint.interval_steps = 2, 10**6, 10**6
    mc = ModelConfig(vocab_size=VOCAB, d_model=32, d_ff=64, n_heads=2, n_encoder_layers=1,
                     n_decoder_layers=1, dropout=0.1)
    return LoopSpec(cfg=cfg.to_dict(), model_config=mc.to_dict(), train_dir=str(shards),
                    tracking_uri=uri, run_id=run_id)


def start_training(tmp_path: Path, uri: str, proxy: FlakyProxy, experiment: str):
    """A run on the server at `uri` and a trainer (max_steps open-ended) tracking to it through
    `proxy`, in a thread, past step 40: (client, run_id, trainer, worker thread, the dict its result
    lands in)."""
    from mlflow import MlflowClient

    torch.set_num_threads(1)
    shards = write_reverse_task(tmp_path / "train", 300, VOCAB, seed=0)
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment(experiment)).info.run_id
    trainer = Trainer(spec_for(shards, proxy.endpoint, run_id, max_steps=10**6, work_dir=tmp_path / "work"),
                      LocalSession(tmp_path / "ck"))
    result: dict = {}
    worker = threading.Thread(target=lambda: result.update(trainer.run()), daemon=True)
    worker.start()
    wait_for_step(trainer, worker, 40)
    return client, run_id, trainer, worker, result


def assert_whole_curve(client, run_id: str, trainer: Trainer, end: int) -> list:
    """Every logged step (2, 4, ..., end) in MLflow exactly once, with the loop's values, and no
    point dropped; the history, by step."""
    history = sorted(client.get_metric_history(run_id, "train/loss"), key=lambda m: m.step)
    assert [m.step for m in history] == list(range(2, end + 1, 2)), "every logged step exactly once, none lost"
    expected = {int(s): loss for s, loss, _, _ in trainer.progress.history_train}
    assert {m.step: m.value for m in history} == pytest.approx(expected, rel=1e-12)
    assert "tracking/dropped_points" not in client.get_run(run_id).data.tags
    return history


def _fail_fast_mlflow(monkeypatch) -> None:
    """MLflow's client gives up on a dead server within seconds (its defaults retry for minutes)."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "3")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")


def server_proxy(uri: str) -> FlakyProxy:
    return FlakyProxy(int(uri.rsplit(":", 1)[1]))


def test_a_tracking_outage_costs_no_training_time(tmp_path, monkeypatch, mlflow_uri):
    _fail_fast_mlflow(monkeypatch)
    proxy = server_proxy(mlflow_uri)
    try:
        client, run_id, trainer, worker, result = start_training(tmp_path, mlflow_uri, proxy, "outage")
        proxy.mode = "refuse"  # the server is gone, from the loop's side
        down_at = trainer.progress.step
        time.sleep(OUTAGE_S)
        proxy.mode = "pass"  # and back
        back_at = trainer.progress.step
        time.sleep(2.0)
        now = trainer.progress.step
        end = now + 40 + now % 2
        trainer.tc.max_steps = end  # stop at a known (even) step, a few windows after the server is back
        worker.join(timeout=120)
        assert not worker.is_alive()
        assert result["final_step"] == end
        assert back_at - down_at > 20, "training stalled while the server was away"

        history = assert_whole_curve(client, run_id, trainer, end)
        # Time between two logged steps, by the loop's own clock (the points' timestamps):
        # while the server was down no window took longer than the usual ones.
        ts = np.array([m.timestamp for m in history], dtype=float) / 1000
        gaps = np.diff(ts)
        during = gaps[down_at // 2:back_at // 2]
        assert len(during) > 5
        usual = float(np.median(gaps))
        print(f"OUTAGE steps {down_at}->{back_at} max gap {during.max():.3f} s usual {usual:.3f} s")
        assert during.max() < 5 * usual + 1.0, (during.max(), usual)
    finally:
        proxy.close()


def wait_for_step(trainer: Trainer, worker: threading.Thread, step: int, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while trainer.progress.step < step:
        assert worker.is_alive(), f"the trainer ended at step {trainer.progress.step} before step {step}"
        assert time.monotonic() < deadline, (f"the trainer did not reach step {step} within {timeout_s} s "
                                             f"(at step {trainer.progress.step})")
        time.sleep(0.05)


def test_training_that_ends_during_an_outage_loses_no_point(tmp_path, monkeypatch, mlflow_uri):
    """The server goes away at step ~40 and training ends 20 steps later, still in the outage: the
    logger waits its close timeout (shortened here), spools what it holds beside the checkpoints,
    and once the server is back the driver's `deliver_spool` (the train stage calls it after the
    workers end) delivers it: every logged step exactly once, with the loop's values."""
    from pipeline.tracking import BufferedRunLogger, MetricSpool, deliver_spool, spool_dir_for

    _fail_fast_mlflow(monkeypatch)
    monkeypatch.setattr(BufferedRunLogger.close, "__defaults__", (8.0,))  # the loop's close waits 60 s
    proxy = server_proxy(mlflow_uri)
    try:
        client, run_id, trainer, worker, result = start_training(tmp_path, mlflow_uri, proxy, "outage-at-end")
        proxy.mode = "refuse"
        now = trainer.progress.step
        end = now + 20 + now % 2
        trainer.tc.max_steps = end  # training ends at a known (even) step while the server is away
        worker.join(timeout=180)
        assert not worker.is_alive(), "the trainer did not end within 180 s"
        assert result["final_step"] == end

        spool_dir = spool_dir_for(trainer.cfg)
        _, points, _ = MetricSpool(spool_dir, run_id).read()
        assert points, f"nothing spooled in {spool_dir} although the server was away at the end"
        assert max(p[1] for p in points) == end, "the last window (logged during the outage) is spooled"
        proxy.mode = "pass"
        assert deliver_spool(spool_dir, proxy.endpoint, run_id, timeout_s=60) == len(points)

        assert_whole_curve(client, run_id, trainer, end)
        assert not MetricSpool(spool_dir, run_id).files(), "delivered spool files are removed"
        assert deliver_spool(spool_dir, proxy.endpoint, run_id) == 0
    finally:
        proxy.close()


def test_driver_calls_to_a_silent_server_fail_in_bounded_time():
    """A server that takes connections and never answers: the driver's call gives up after
    tracking.timeout_s, naming the server (MLflow alone would wait 7 retries x 120 s)."""
    import socket

    from pipeline.tracking import RunLogger, TrackingUnavailable

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        uri = f"http://127.0.0.1:{silent.getsockname()[1]}"
        t0 = time.monotonic()
        with pytest.raises(TrackingUnavailable, match=f"MLflow tracking server {uri} did not answer set_tag "
                                                      r"within tracking.timeout_s=2 s"):
            RunLogger(uri, "0" * 32, timeout_s=2.0).set_tags({"a": "b"})
        assert time.monotonic() - t0 < 10
