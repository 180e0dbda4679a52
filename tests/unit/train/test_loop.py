"""The per-worker training loop in-process (one worker, no Ray): determinism, resume, checkpoints."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import torch

from model import ModelConfig
from pipeline.train import checkpoint as train_checkpoint
from pipeline.config import Config
from pipeline.train.loop import LocalSession, LoopSpec, train_worker
from pipeline.train.session import SESSION_WRAPPER_ENV
from tests.support import faults
from tests.support.synthetic import write_reverse_task

VOCAB = 64


@pytest.fixture(autouse=True)
def one_thread():
    """Two cores shared with other jobs: one intra-op thread is faster and steadier."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("shards")
    return (write_reverse_task(root / "train", 300, VOCAB, seed=0),
            write_reverse_task(root / "dev", 40, VOCAB, seed=1))


def tiny_spec(shards, **settings) -> dict:
    """A tiny model's LoopSpec; `settings`: a train field by name (``max_steps=6``), any other
    section's as ``<section>_<field>`` (``speed_precision="auto"``, ``checkpoint_interval_steps=5``)."""
    cfg = Config()
    cfg.model.d_model, cfg.model.d_ff, cfg.model.n_heads = 32, 64, 2
    cfg.model.n_encoder_layers = cfg.model.n_decoder_layers = 1
    t = cfg.train
    t.max_steps, t.tokens_per_step, cfg.speed.max_tokens_per_batch, t.warmup_steps = 12, 500, 200, 8
    cfg.metrics.log_interval_steps, cfg.metrics.val_loss_interval_steps, cfg.checkpoint.interval_steps = 1, 6, 4
    cfg.speed.precision = "fp32"  # these tests check the loop's arithmetic; bf16 is tests/unit/train/test_precision.py
    for k, v in settings.items():
        section = next((s for s in ("speed", "workers", "checkpoint", "metrics") if k.startswith(f"{s}_")), "train")
        name = k if section == "train" else k[len(section) + 1:]
        assert hasattr(getattr(cfg, section), name), f"tiny_spec: no {section}.{name}"
        setattr(getattr(cfg, section), name, v)
    mc = ModelConfig(vocab_size=VOCAB, d_model=32, d_ff=64, n_heads=2, n_encoder_layers=1,
                     n_decoder_layers=1, dropout=0.1)
    return LoopSpec(cfg=cfg.to_dict(), model_config=mc.to_dict(), train_dir=str(shards[0]),
                    dev_dir=str(shards[1])).to_dict()


def test_same_seed_same_losses(shards, tmp_path):
    a = train_worker(tiny_spec(shards, max_steps=6), LocalSession(tmp_path / "a"))
    b = train_worker(tiny_spec(shards, max_steps=6), LocalSession(tmp_path / "b"))
    assert [h[1] for h in a["history_train"]] == [h[1] for h in b["history_train"]]
    c = train_worker(tiny_spec(shards, max_steps=6, seed=2), LocalSession(tmp_path / "c"))
    assert [h[1] for h in a["history_train"]] != [h[1] for h in c["history_train"]]


def test_loss_falls_and_every_step_uses_its_token_budget(shards, tmp_path):
    out = train_worker(tiny_spec(shards, max_steps=24, checkpoint_interval_steps=24), LocalSession(tmp_path))
    losses = [h[1] for h in out["history_train"]]
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 0.3
    assert out["final_step"] == 24
    # Each step holds >= half of tokens_per_step target tokens, and the loop counted all of them.
    assert 24 * 250 <= out["tokens_seen"]["tgt"] <= 24 * (500 + 21)
    assert len(out["history_val"]) == 4  # steps 6, 12, 18, 24


def test_resume_from_a_checkpoint_replays_the_uninterrupted_run(shards, tmp_path):
    straight = LocalSession(tmp_path / "straight")
    full = train_worker(tiny_spec(shards), straight)
    resumed = LocalSession(tmp_path / "resumed")
    train_worker(tiny_spec(shards, max_steps=6), resumed)  # stops (and checkpoints) at step 6
    second = train_worker(tiny_spec(shards), resumed)
    assert second["start_step"] == 6 and second["final_step"] == 12
    assert second["history_train"] == full["history_train"]  # same batches, dropout masks, updates
    a = torch.load(straight.checkpoints()[-1] / "model.pt", weights_only=True)
    b = torch.load(resumed.checkpoints()[-1] / "model.pt", weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_checkpoint_folder_follows_the_stage_contract(shards, tmp_path):
    session = LocalSession(tmp_path)
    train_worker(tiny_spec(shards, max_steps=8), session)
    names = [p.name for p in session.checkpoints()]
    assert names == ["checkpoint_0000004", "checkpoint_0000008"]
    last = session.checkpoints()[-1]
    assert sorted(p.name for p in last.iterdir()) == sorted(train_checkpoint.FILES)
    meta = json.loads((last / "meta.json").read_text())
    assert meta["step"] == 8 and ModelConfig.from_dict(meta["model_config"]).vocab_size == VOCAB
    state = torch.load(last / "train_state.pt", weights_only=True)
    assert state["step"] == 8 and {"optimizer", "scheduler", "rng", "epoch", "step_in_epoch"} <= set(state)
    assert isinstance(state["rng"]["torch"], torch.Tensor)
    assert state["scheduler"]["last_epoch"] == 8  # the lr schedule advanced once per step
    weights = torch.load(last / "model.pt", weights_only=True)
    assert all(t.device.type == "cpu" for t in weights.values())


@pytest.mark.parametrize("upload", ["async", "sync"])
def test_a_stored_checkpoint_leaves_no_temporary_folder(shards, tmp_path, monkeypatch, upload):
    """Each checkpoint is written to a fresh temporary folder; once stored, none may remain (a
    long run would otherwise fill the machine's temporary space with every checkpoint it wrote)."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    session = LocalSession(tmp_path / "store")
    train_worker(tiny_spec(shards, max_steps=8, checkpoint_upload=upload), session)
    assert [p.name for p in session.checkpoints()] == ["checkpoint_0000004", "checkpoint_0000008"]
    assert all(sorted(p.name for p in c.iterdir()) == sorted(train_checkpoint.FILES) for c in session.checkpoints())
    assert sorted(p.name for p in scratch.glob("checkpoint_*")) == []


def test_session_wrapper_injects_a_fault_once(shards, tmp_path):
    """The fault injection of the integration tests (tests/support/faults.py) reaches the loop
    through `LoopSpec.session_wrapper` only: the loop itself has no test switch."""
    spec = tiny_spec(shards, max_steps=4)
    spec["session_wrapper"] = faults.env(3, tmp_path / "failed")[SESSION_WRAPPER_ENV]
    session = LocalSession(tmp_path / "ck")
    with pytest.raises(RuntimeError, match="injected failure before step 3"):
        train_worker(spec, session)
    assert (tmp_path / "failed").read_text() == "3"
    out = train_worker(spec, session)  # marker written: no second failure; resumes from step 0
    assert out["final_step"] == 4


def test_time_interval_checkpoints(shards, tmp_path):
    session = LocalSession(tmp_path)
    train_worker(tiny_spec(shards, max_steps=3, checkpoint_interval_steps=100, checkpoint_interval_s=1e-9),
                 session)
    assert [p.name for p in session.checkpoints()] == [f"checkpoint_000000{i}" for i in (1, 2, 3)]


def test_every_point_up_to_a_checkpoint_is_on_disk_when_the_server_is_away(shards, tmp_path, monkeypatch):
    """The tracking server is away for the whole run and the process dies at the end (its close
    spools nothing): each checkpoint spooled every point logged since the one before, so a resumed
    worker delivers the whole curve up to its checkpoint before the steps it replays."""
    from pipeline.tracking import BufferedRunLogger, MetricSpool
    from tests.support.fake_mlflow import FakeMlflow

    store = FakeMlflow(monkeypatch)
    run_id = store.create_run()
    store.up = False
    monkeypatch.setattr(BufferedRunLogger, "close", lambda self, timeout_s=60.0: self._queue.stop() and False)
    spec = tiny_spec(shards, max_steps=10, checkpoint_interval_steps=4)  # checkpoints at steps 4, 8 and 10
    spec.update(tracking_uri="fake", run_id=run_id)
    spec["cfg"]["run"]["work_dir"] = str(tmp_path / "work")
    out = train_worker(spec, LocalSession(tmp_path / "ck"))
    spool = MetricSpool(str(tmp_path / "work" / "ray_train" / "tracking_spool"), run_id)
    per_file = [[json.loads(line) for line in Path(f).read_text().splitlines()[1:]] for f in spool.files()]
    assert [[p["step"] for p in points if "train/loss" in p["metrics"]] for points in per_file] == [
        [1, 2, 3, 4], [5, 6, 7, 8], [9, 10]]
    losses = {p["step"]: p["metrics"]["train/loss"] for points in per_file for p in points
              if "train/loss" in p["metrics"]}
    assert losses == {int(s): loss for s, loss, _, _ in out["history_train"]}
    assert [p["step"] for points in per_file for p in points if "val/loss" in p["metrics"]] == [6, 10]  # and at the end
    assert store.metric_steps(run_id, "train/loss") == []
