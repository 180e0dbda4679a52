"""Early stopping (train.early_stop_patience): a scripted metric sequence stops the run at the
right validation, a restart continues the count from what was logged, the plan refuses a patience
that could leave `average` short, and the report says the run stopped early."""

from __future__ import annotations

import json

import pytest
import torch

from pipeline.config import Config, ConfigError, load_config
from pipeline.dag import BY_NAME, compute_keys
from pipeline.evaluate.score import _early_stop_lines
from pipeline.decoding.selection import early_stop_check, plan_check
from pipeline.train import checkpoint as train_checkpoint
from pipeline.train.early_stop import EarlyStop
from pipeline.train.loop import LocalSession, train_worker
from pipeline.train.session import SESSION_WRAPPER_ENV
from pipeline.train.dev_loss import DevLoss
from tests.support import faults
from tests.unit.train.test_loop import one_thread, shards, tiny_spec  # noqa: F401 (fixtures)

# Dev BLEU of the checkpoints at steps 4, 8, ...: the best (12) at step 8, then 11, 12 (a tie is no
# improvement, as fairseq's `is_better`), 11.5: with patience 3 the run stops at the 5th validation.
BLEU = [10.0, 12.0, 11.0, 12.0, 11.5, 13.0, 14.0]


def test_a_scripted_sequence_stops_at_the_patience_th_validation_without_improvement():
    e = EarlyStop(patience=3, metric="dev_bleu")
    stops = [e.observe(4 * (i + 1), v) for i, v in enumerate(BLEU[:5])]
    assert stops == [False, False, False, False, True]
    assert (e.best, e.best_step, e.num_bad) == (12.0, 8, 3)
    loss = EarlyStop(patience=2, metric="val_loss")  # lower is better
    assert [loss.observe(s, v) for s, v in [(1, 5.0), (2, 4.0), (3, 4.5), (4, 3.9), (5, 4.0), (6, 3.95)]] == \
        [False, False, False, False, False, True]
    assert loss.observe(6, 0.0) is False  # a value is taken once per step


def test_replay_continues_the_count_where_the_log_left_it():
    straight = EarlyStop(patience=3, metric="dev_bleu")
    expected = [straight.observe(4 * (i + 1), v) for i, v in enumerate(BLEU)].index(True)
    resumed = EarlyStop(patience=3, metric="dev_bleu")
    logged = [(4 * (i + 1), v) for i, v in enumerate(BLEU)]
    assert resumed.replay(logged, up_to=12) is False  # restored at step 12: 10, 12, 11 seen
    assert resumed.num_bad == 1
    stop_at = next(i for i in range(3, len(BLEU)) if resumed.observe(4 * (i + 1), BLEU[i]))
    assert stop_at == expected


def write_records(folder, values, every=4):
    d = folder / "dev_bleu"
    d.mkdir(parents=True)
    for i, v in enumerate(values):
        step = every * (i + 1)
        name = train_checkpoint.checkpoint_dir_name(step)
        (d / f"{name}.json").write_text(json.dumps({"checkpoint": name, "step": step, "status": "validated",
                                                    "bleu_sacre": v}))
    return folder


def dev_bleu_spec(shards, records, **train):
    train = {"max_steps": 40, "checkpoint_interval_steps": 4, "metrics_val_loss_interval_steps": 100,
             "checkpoint_num_to_keep": 10, "early_stop_patience": 3, "early_stop_metric": "dev_bleu", **train}
    spec = tiny_spec(shards, **train)
    spec["dev_bleu_dir"] = str(records)
    return spec


def test_the_loop_stops_on_dev_bleu_and_a_restart_continues_the_count(shards, tmp_path):
    records = write_records(tmp_path / "run", BLEU)
    straight = train_worker(dev_bleu_spec(shards, records), LocalSession(tmp_path / "straight"))
    assert straight["final_step"] == 20
    assert straight["early_stop"] == {"step": 20, "max_steps": 40, "metric": "dev_bleu", "patience": 3,
                                      "best": 12.0, "best_step": 8, "num_bad": 3}

    # A crash before step 14: the restart resumes at checkpoint 12 with one bad validation counted.
    spec = dev_bleu_spec(shards, records)
    spec["session_wrapper"] = faults.env(14, tmp_path / "crashed")[SESSION_WRAPPER_ENV]
    session = LocalSession(tmp_path / "crash")
    with pytest.raises(RuntimeError, match="injected failure"):
        train_worker(spec, session)
    resumed = train_worker(spec, session)
    assert resumed["start_step"] == 12 and resumed["final_step"] == 20
    assert resumed["early_stop"] == straight["early_stop"]
    assert resumed["history_train"] == straight["history_train"]
    state = torch.load(session.checkpoints()[-1] / train_checkpoint.STATE_FILE, weights_only=True)
    assert state["step"] == 20 and state["early_stop"]["step"] == 20  # the stop is in the checkpoint

    again = train_worker(spec, session)  # a rerun of a stopped run ends at once
    assert again["start_step"] == again["final_step"] == 20 and again["early_stop"]["step"] == 20


def test_off_by_default_the_run_ignores_the_records(shards, tmp_path):
    spec = dev_bleu_spec(shards, write_records(tmp_path / "run", BLEU), early_stop_patience=0)
    spec["cfg"]["train"]["max_steps"] = 24
    assert train_worker(spec, LocalSession(tmp_path / "ck"))["early_stop"] is None


def test_val_loss_stops_between_checkpoints_with_a_checkpoint_of_its_own(shards, tmp_path, monkeypatch):
    losses = iter([5.0, 4.0, 4.5, 4.2, 4.1, 3.0])  # validations at steps 2, 4, ..., best at 4

    def scripted(self, model):  # the sums of one worker: a loss of v over one target token
        v = next(losses)
        return torch.tensor([v, v, 1.0], dtype=torch.float64)

    monkeypatch.setattr(DevLoss, "sums", scripted)
    session = LocalSession(tmp_path)
    out = train_worker(tiny_spec(shards, max_steps=40, metrics_val_loss_interval_steps=2, checkpoint_interval_steps=4,
                                 early_stop_patience=3, early_stop_metric="val_loss"), session)
    assert out["final_step"] == 10 and out["early_stop"]["best_step"] == 4
    assert session.checkpoints()[-1].name == train_checkpoint.checkpoint_dir_name(10)


def test_the_metric_must_exist(shards, tmp_path):
    spec = tiny_spec(shards, early_stop_patience=2, early_stop_metric="dev_bleu")  # no dev_bleu_dir
    with pytest.raises(ConfigError, match="needs dev BLEU"):
        train_worker(spec, LocalSession(tmp_path))
    with pytest.raises(ConfigError, match="dev_bleu.enabled"):
        load_config(None, ["--train.early_stop_patience=2", "--dev_bleu.enabled=false"])


def test_patience_is_in_the_train_key_only_when_set():
    base = compute_keys(load_config(None, []))
    assert "early_stop_patience" not in BY_NAME["train"].key_material(load_config(None, []))["train"]
    on = compute_keys(load_config(None, ["--train.early_stop_patience=5"]))
    assert on["train"] != base["train"] and on["vocab"] == base["vocab"]


def plan_cfg(*overrides: str, **train) -> Config:
    cfg = load_config(None, [*overrides, *(f"--train.{k}={v}" for k, v in train.items())])
    return cfg


def test_plan_refuses_a_patience_that_can_leave_average_short():
    # val_loss: the earliest stop is (2 + 1) x 1000 = step 3000, 3 checkpoints < average_last 5
    with pytest.raises(ConfigError, match="train.early_stop_patience = 2"):
        plan_check(plan_cfg(early_stop_patience=2, early_stop_metric="val_loss"))
    assert early_stop_check(plan_cfg("--checkpoint.interval_steps=500", early_stop_patience=2,
                                     early_stop_metric="val_loss")) is None  # 6 checkpoints by step 3000
    with pytest.raises(ConfigError, match="dev_bleu"):
        plan_check(plan_cfg(early_stop_patience=3))  # 4 validated checkpoints < 5
    note = plan_check(plan_cfg(early_stop_patience=10))
    assert "rotated out" in note and "checkpoint.num_to_keep = 5" in note
    assert plan_check(plan_cfg(early_stop_patience=4)) is None


def test_the_report_says_the_run_stopped_early():
    record = {"step": 20, "max_steps": 40, "metric": "dev_bleu", "patience": 3, "best": 12.0, "best_step": 8,
              "num_bad": 3}
    (line,) = _early_stop_lines({"early_stop": record})
    assert "stopped early" in line and "step 20 of train.max_steps = 40" in line and "best 12.0000 at step 8" in line
    assert _early_stop_lines({"early_stop": None}) == [] and _early_stop_lines({}) == []
