"""The buffered metrics path (pipeline/tracking/buffered.py, spool.py) against a tracking server that
goes away.

`BufferedRunLogger` drops points past its limits (`tracking/dropped_points` counts them), and
what it still holds when it closes is spooled durably and delivered later, in order and once:
by the next logger of the run (a restarted worker), by the driver (`deliver_spool`, the train
stage) or by the next invocation (`Tracking.deliver_spools`). The server is an in-memory fake
(tests/support/fake_mlflow.py); one test uses MLflow's real client against a closed port.
"""

from __future__ import annotations

import json
import shutil
import socket
import threading
import time
import types

import pytest

from pipeline import tracking
from pipeline.config import Config
from pipeline.tracking import BufferedRunLogger, MetricSpool, Tracking, buffered, deliver_spool, spool_dir_for
from tests.support.fake_mlflow import FakeMlflow

TAG = "tracking/dropped_points"


def wait_until(cond, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.01)


@pytest.fixture
def store(monkeypatch):
    return FakeMlflow(monkeypatch)


def loss(step: int) -> float:
    return 10.0 / step


def log_steps(logger: BufferedRunLogger, steps) -> None:
    for s in steps:
        logger.log_metrics({"train/loss": loss(s), "train/lr": s * 1e-4}, step=s)


# --- the drop path ------------------------------------------------------------------------------

def test_points_past_max_points_are_dropped_oldest_first_and_counted_in_the_tag(store):
    run_id = store.create_run()
    store.up = False
    logger = BufferedRunLogger("fake", run_id, retry_s=0.01, max_points=3)
    log_steps(logger, range(1, 8))  # 7 points, room for 3: steps 1-4 are dropped as they come
    assert logger.dropped == 4 and logger.pending() == 3
    store.up = True
    assert logger.close(timeout_s=30)
    assert store.metric_steps(run_id, "train/loss") == [5, 6, 7]
    assert store.metric_values(run_id, "train/loss") == {s: loss(s) for s in (5, 6, 7)}
    assert store.tags(run_id)[TAG] == "4"


def test_points_older_than_buffer_s_are_dropped_and_the_count_adds_to_the_runs_tag(store, monkeypatch):
    """The clock the logger stamps and ages points by is the test's: no race with the thread."""
    clock = {"now": 1000.0}
    fake_time = types.SimpleNamespace(**{k: getattr(time, k) for k in dir(time) if not k.startswith("_")})
    fake_time.time = lambda: clock["now"]
    monkeypatch.setattr(buffered, "time", fake_time)  # the module that stamps and ages the points
    run_id = store.create_run()
    store.runs[run_id]["tags"][TAG] = "5"  # an earlier worker of this run dropped 5
    store.up = False
    logger = BufferedRunLogger("fake", run_id, buffer_s=60.0, retry_s=0.01)
    log_steps(logger, [2, 4, 6])
    clock["now"] += 61.0  # steps 2-6 are now older than the buffer
    log_steps(logger, [8, 10])
    wait_until(lambda: logger.dropped == 3, "the thread dropping the 3 points older than buffer_s")
    assert logger.pending() == 2
    store.up = True
    assert logger.close(timeout_s=30)
    assert store.metric_steps(run_id, "train/loss") == [8, 10]
    assert store.tags(run_id)[TAG] == "8"  # 5 + 3: added, not overwritten


def test_no_drop_no_tag(store):
    run_id = store.create_run()
    logger = BufferedRunLogger("fake", run_id, retry_s=0.01)
    log_steps(logger, range(1, 6))
    assert logger.close(timeout_s=30)
    assert store.metric_steps(run_id, "train/loss") == [1, 2, 3, 4, 5] and TAG not in store.tags(run_id)


# --- the spool: nothing lost when training ends during an outage ---------------------------------

def close_during_outage(store, run_id: str, spool_dir, steps, **kw) -> BufferedRunLogger:
    store.up = False
    logger = BufferedRunLogger("fake", run_id, retry_s=0.01, spool_dir=str(spool_dir), **kw)
    log_steps(logger, steps)
    assert not logger.close(timeout_s=0.3), "a server that is away took the points"
    return logger


def test_close_during_an_outage_spools_every_point_in_order(store, tmp_path):
    run_id = store.create_run()
    logger = close_during_outage(store, run_id, tmp_path, range(1, 7))
    assert logger.spooled == 6 and store.metric_steps(run_id, "train/loss") == []
    (path,) = tmp_path.joinpath(run_id).glob("*.jsonl")
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert lines[0] == {"run_id": run_id, "tracking_uri": "fake", "dropped": 0}
    assert [x["step"] for x in lines[1:]] == [1, 2, 3, 4, 5, 6]
    assert [x["metrics"]["train/loss"] for x in lines[1:]] == [loss(s) for s in range(1, 7)]


def test_the_driver_delivers_the_spool_once_in_order(store, tmp_path):
    run_id = store.create_run()
    close_during_outage(store, run_id, tmp_path, range(1, 251))  # more than one batch of 100
    (path,) = tmp_path.joinpath(run_id).glob("*.jsonl")
    kept = path.read_bytes()
    store.up = False
    assert deliver_spool(str(tmp_path), "fake", run_id) == 250  # still away: pending, kept
    assert path.exists() and store.metric_steps(run_id, "train/loss") == []
    store.up = True
    assert deliver_spool(str(tmp_path), "fake", run_id) == 250
    assert store.metric_steps(run_id, "train/loss") == list(range(1, 251))
    assert store.metric_values(run_id, "train/lr") == pytest.approx({s: s * 1e-4 for s in range(1, 251)})
    assert not list(tmp_path.joinpath(run_id).glob("*.jsonl"))
    assert deliver_spool(str(tmp_path), "fake", run_id) == 0  # nothing left
    # A driver that died after delivering and before removing the file: delivered again, no duplicate.
    path.write_bytes(kept)
    assert deliver_spool(str(tmp_path), "fake", run_id) == 250
    assert store.metric_steps(run_id, "train/loss") == list(range(1, 251))
    assert TAG not in store.tags(run_id)


def test_spooled_drops_reach_the_tag(store, tmp_path):
    run_id = store.create_run()
    close_during_outage(store, run_id, tmp_path, range(1, 6), max_points=2)  # 3 dropped, 2 spooled
    store.up = True
    assert deliver_spool(str(tmp_path), "fake", run_id) == 2
    assert store.metric_steps(run_id, "train/loss") == [4, 5] and store.tags(run_id)[TAG] == "3"


def test_a_restarted_worker_delivers_the_spool_before_its_own_points(store, tmp_path):
    """Attempt 1 logged steps 1-6 and closed during an outage; attempt 2 resumed from the
    checkpoint at step 4 and logs steps 5-9 again (the same values: the loop is deterministic)."""
    run_id = store.create_run()
    close_during_outage(store, run_id, tmp_path, range(1, 7))
    store.up = True
    logger = BufferedRunLogger("fake", run_id, retry_s=0.01, spool_dir=str(tmp_path))
    log_steps(logger, range(5, 10))
    assert logger.close(timeout_s=30)
    assert store.metric_steps(run_id, "train/loss") == list(range(1, 10))  # once each, in order
    assert not list(tmp_path.joinpath(run_id).glob("*.jsonl"))


def test_a_worker_that_closes_again_during_the_outage_keeps_both_attempts_points(store, tmp_path):
    run_id = store.create_run()
    close_during_outage(store, run_id, tmp_path, range(1, 4))
    logger = close_during_outage(store, run_id, tmp_path, range(4, 7))  # it loaded 1-3, spools 1-6
    assert logger.spooled == 6
    files = sorted(tmp_path.joinpath(run_id).glob("*.jsonl"))
    assert len(files) == 1, "the loaded file is replaced by the new one"
    store.up = True
    assert deliver_spool(str(tmp_path), "fake", run_id) == 6
    assert store.metric_steps(run_id, "train/loss") == [1, 2, 3, 4, 5, 6]


def test_spooled_points_are_never_dropped_by_the_buffers_limits(store, tmp_path):
    run_id = store.create_run()
    close_during_outage(store, run_id, tmp_path, range(1, 6))  # 5 spooled
    logger = BufferedRunLogger("fake", run_id, retry_s=0.01, max_points=2, spool_dir=str(tmp_path))
    log_steps(logger, [6])
    wait_until(lambda: logger.pending() == 6, "the thread queueing the 5 spooled points before step 6")
    log_steps(logger, [7, 8])  # 3 of the logger's own now: step 6 is dropped, the spooled ones stay
    assert logger.dropped == 1
    store.up = True
    assert logger.close(timeout_s=30)
    assert store.metric_steps(run_id, "train/loss") == [1, 2, 3, 4, 5, 7, 8] and store.tags(run_id)[TAG] == "1"


def test_close_against_a_closed_port_spools_with_mlflows_own_client(tmp_path, monkeypatch):
    """No fake: MLflow's HTTP client gets a refused connection (its retries shortened)."""
    from mlflow import MlflowClient  # noqa: F401 (imported before the env vars are read per request)

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        uri = f"http://127.0.0.1:{s.getsockname()[1]}"  # closed once the block ends: connections refused
    logger = BufferedRunLogger(uri, "0" * 32, retry_s=0.05, spool_dir=str(tmp_path))
    log_steps(logger, range(1, 4))
    assert not logger.close(timeout_s=2)
    _, points, dropped = MetricSpool(str(tmp_path), "0" * 32).read()
    assert [p[1] for p in points] == [1, 2, 3] and dropped == 0


# --- the spool at a checkpoint: nothing lost when the process is killed -------------------------

def killed(logger: BufferedRunLogger) -> None:
    """What SIGKILL leaves of a logger: its thread stops at its next turn, nothing is spooled."""
    logger._queue.stop()


def test_a_killed_worker_loses_no_point_logged_before_its_checkpoint(store, tmp_path):
    """Attempt 1 logs steps 1-6 while the server is away, checkpoints at step 6, and is killed;
    attempt 2 resumes from that checkpoint and logs steps 7-9."""
    run_id = store.create_run()
    store.up = False
    first = BufferedRunLogger("fake", run_id, retry_s=0.01, spool_dir=str(tmp_path))
    log_steps(first, range(1, 7))
    assert first.spool_pending() == 6
    killed(first)
    store.up = True
    second = BufferedRunLogger("fake", run_id, retry_s=0.01, spool_dir=str(tmp_path))
    log_steps(second, range(7, 10))
    assert second.close(timeout_s=30)
    assert store.metric_steps(run_id, "train/loss") == list(range(1, 10))  # once each, in order
    assert not list(tmp_path.joinpath(run_id).glob("*.jsonl")), "delivered: the checkpoint's file is removed"


def test_points_spooled_at_a_checkpoint_are_delivered_once_and_their_file_removed(store, tmp_path):
    run_id = store.create_run()
    store.up = False
    logger = BufferedRunLogger("fake", run_id, retry_s=0.01, max_points=2, buffer_s=60.0, spool_dir=str(tmp_path))
    log_steps(logger, [1, 2])
    assert logger.spool_pending() == 2 and len(list(tmp_path.joinpath(run_id).glob("*.jsonl"))) == 1
    log_steps(logger, [3, 4, 5])  # room for 2 own points: step 3 is dropped, the spooled 1-2 stay
    assert logger.dropped == 1 and logger.pending() == 4
    store.up = True
    assert logger.close(timeout_s=30)
    assert store.metric_steps(run_id, "train/loss") == [1, 2, 4, 5]
    assert not list(tmp_path.joinpath(run_id).glob("*.jsonl"))


def test_a_checkpoints_file_whose_points_were_delivered_while_it_was_written_is_removed(store, tmp_path):
    run_id = store.create_run()
    store.up = False
    logger = BufferedRunLogger("fake", run_id, retry_s=0.01, spool_dir=str(tmp_path))
    log_steps(logger, [1, 2, 3])
    write = logger.spool.store.write

    def write_once_delivered(*args):
        store.up = True
        wait_until(lambda: logger.pending() == 0, "the thread delivering steps 1-3")
        return write(*args)

    logger.spool.store.write = write_once_delivered
    assert logger.spool_pending() == 3
    assert not list(tmp_path.joinpath(run_id).glob("*.jsonl")), "all its points were delivered"
    assert logger.close(timeout_s=30) and store.metric_steps(run_id, "train/loss") == [1, 2, 3]


def test_a_checkpoint_whose_spool_cannot_be_written_keeps_its_points_waiting(store, tmp_path, caplog):
    run_id = store.create_run()
    store.up = False
    logger = BufferedRunLogger("fake", run_id, retry_s=0.01, max_points=3, spool_dir=str(tmp_path))
    log_steps(logger, [1, 2, 3])

    def storage_away(*args):
        raise OSError("the bucket is away")

    logger.spool.store.write = storage_away
    assert logger.spool_pending() == 0
    assert "could not spool 3 metric point(s)" in caplog.text and "they wait in memory" in caplog.text
    log_steps(logger, [4])  # still the logger's own: the limits apply, step 1 is dropped
    assert logger.dropped == 1 and logger.pending() == 3
    store.up = True
    assert logger.close(timeout_s=30)
    assert store.metric_steps(run_id, "train/loss") == [2, 3, 4]


def test_an_earlier_workers_spool_goes_before_points_this_worker_spooled_first(store, tmp_path):
    """The thread reads the run's spool when it starts; a checkpoint may spool this worker's own
    points before that read: the earlier worker's (older) points still go first, and this worker's
    own file is not read back."""
    run_id = store.create_run()
    close_during_outage(store, run_id, tmp_path, range(1, 7))  # attempt 1: steps 1-6 spooled
    logger = BufferedRunLogger("fake", run_id, retry_s=0.01, spool_dir=str(tmp_path))
    gate, read = threading.Event(), logger.spool.store.read
    logger.spool.store.read = lambda **kw: (gate.wait(30), read(**kw))[1]
    log_steps(logger, [5, 6, 7])  # attempt 2 resumed at step 4; its thread waits at the read
    assert logger.spool_pending() == 3
    gate.set()
    wait_until(lambda: logger.pending() == 9, "the thread queueing attempt 1's 6 points")
    time.sleep(0.1)
    assert logger.pending() == 9, "its own file was read back"
    store.up = True
    log_steps(logger, [8])
    assert logger.close(timeout_s=30)
    assert store.metric_steps(run_id, "train/loss") == list(range(1, 9))
    assert not list(tmp_path.joinpath(run_id).glob("*.jsonl"))


def test_the_next_invocation_delivers_the_spools_of_runs_that_ended(store, tmp_path):
    cfg = Config()
    cfg.run.work_dir = str(tmp_path / "work")
    cfg.tracking.uri = "fake"
    root = spool_dir_for(cfg)
    assert root == f"{tmp_path}/work/ray_train/tracking_spool"
    ended, running = store.create_run(status="FAILED"), store.create_run(status="RUNNING")
    close_during_outage(store, ended, root, range(1, 4))
    close_during_outage(store, running, root, range(1, 3))
    store.up = True
    assert Tracking(cfg).deliver_spools() == 3
    assert store.metric_steps(ended, "train/loss") == [1, 2, 3]
    assert store.metric_steps(running, "train/loss") == [], "a RUNNING run's stage delivers its own spool"
    assert tracking.spooled_run_ids(root) == [running]


def test_a_spool_copied_twice_is_still_delivered_once(store, tmp_path):
    """Two files holding the same points (a copy, or a re-spool whose old file was not removed)."""
    run_id = store.create_run()
    close_during_outage(store, run_id, tmp_path, range(1, 5))
    (path,) = tmp_path.joinpath(run_id).glob("*.jsonl")
    shutil.copy(path, path.with_name("99999999999999999999-copy.jsonl"))
    store.up = True
    assert deliver_spool(str(tmp_path), "fake", run_id) == 8
    assert store.metric_steps(run_id, "train/loss") == [1, 2, 3, 4]


def test_a_sent_batch_leaves_the_queue_even_when_a_drop_took_some_of_it_during_the_send():
    """The thread sends a batch outside the lock; `log_metrics` may drop its oldest own points
    meanwhile. What is removed afterwards is the rest of that batch, nothing after it."""
    now = time.time()  # the points are fresh: buffer_s drops none of them
    q = buffered.MetricQueue(max_points=2, buffer_s=60.0)
    q.put_spooled([(now, 0, {"x": 0.0})], ["spooled.jsonl"], dropped=0)
    a, b, c = (buffered.QueuedPoint(now + s, s, {"x": float(s)}) for s in (1, 2, 3))
    q.put(a)
    q.put(b)
    sent = q.next_batch(3)
    assert [p.step for p in sent] == [0, 1, 2]
    q.put(c)  # three own points for room for two: a, in the batch being sent, is dropped
    assert q.dropped == 1
    assert q.remove(sent) == ["spooled.jsonl"], "every spooled point is delivered: its file can go"
    left, untagged, files = q.stop()
    assert left == [(now + 3, 3, {"x": 3.0})] and untagged == 1 and files == []
