"""A SIGTERM becomes a checkpoint at the next step boundary; the ranks agree on that step."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pipeline.train import preemption
from pipeline.train.agreement import Local, StepAgreement, verdict
from pipeline.train.loop import LocalSession, LoopSpec, Trainer, train_worker
from tests.unit.train.test_loop import one_thread, shards, tiny_spec  # noqa: F401 (fixtures)


def sigterm_at(trainer: Trainer, step: int, sent: dict) -> threading.Thread:
    """SIGTERM this process once the trainer has done `step` steps; `sent["step"]` says when."""
    def watch() -> None:
        deadline = time.monotonic() + 120
        while trainer.progress.step < step:
            if time.monotonic() > deadline:
                sent["error"] = f"the trainer did not reach step {step} within 120 s (at {trainer.progress.step})"
                return
            time.sleep(0.001)
        sent["step"] = trainer.progress.step
        os.kill(os.getpid(), signal.SIGTERM)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t


@pytest.fixture(autouse=True)
def no_notice():
    preemption.reset()
    before = signal.getsignal(signal.SIGTERM)
    yield
    preemption.reset()
    assert signal.getsignal(signal.SIGTERM) == before  # the loop put the handler back


def test_sigterm_becomes_a_checkpoint_and_the_rerun_resumes_there(shards, tmp_path):
    spec = tiny_spec(shards, max_steps=20, checkpoint_interval_steps=5, metrics_val_loss_interval_steps=100)
    straight = train_worker(spec, LocalSession(tmp_path / "straight"))

    session = LocalSession(tmp_path / "preempted")
    trainer, sent = Trainer(LoopSpec(**spec), session), {}
    sigterm_at(trainer, 7, sent)
    with pytest.raises(preemption.Preempted, match="after a checkpoint"):
        trainer.run()
    steps = [int(p.name.split("_")[1]) for p in session.checkpoints()]
    # The step in progress when the signal came is finished and saved: nothing is lost. (The watcher
    # reads the step after the loop counted it: a signal that lands before the loop's check at that
    # boundary is saved there, at sent["step"].)
    assert steps[:1] == [5] and len(steps) == 2 and steps[1] in (sent["step"], sent["step"] + 1,
                                                                 sent["step"] + 2), (steps, sent)
    assert trainer.progress.step == steps[1]

    preemption.reset()
    resumed = train_worker(spec, session)
    assert resumed["start_step"] == steps[1] and resumed["final_step"] == 20
    assert resumed["history_train"] == straight["history_train"]  # the same run, step for step


def test_a_notice_shorter_than_a_save_stops_without_a_checkpoint(shards, tmp_path):
    spec = tiny_spec(shards, max_steps=20, checkpoint_interval_steps=5, metrics_val_loss_interval_steps=100,
                     workers_preemption_grace_s=1e-6)
    session = LocalSession(tmp_path / "short")
    trainer, sent = Trainer(LoopSpec(**spec), session), {}
    sigterm_at(trainer, 7, sent)
    with pytest.raises(preemption.Preempted, match="without a checkpoint"):
        trainer.run()
    assert [p.name for p in session.checkpoints()] == ["checkpoint_0000005"]  # the interval one only


def _rank(rank: int, port: int, notice_rank: int, notice_step: int, out) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        agreement, notice = StepAgreement(2), preemption.Notice(grace_s=25.0, rank=rank)
        for step in range(1, 10):
            time.sleep(0.01 * (rank + 1))  # the ranks reach each boundary at different times
            if rank == notice_rank and step == notice_step:
                preemption._on_sigterm(signal.SIGTERM, None)
            notice.save_s = 2.0 if rank == 0 else 0.0
            local = Local(step_and_save_s=0.5 * (rank + 1) + notice.save_s, save_s=notice.save_s)
            if notice.received:
                local.grace_left_s = notice.grace_left(step)
            agreed = agreement.exchange(local, blocking=False)  # an ordinary step: neither logs nor validates
            stop, fits = verdict(agreed)
            if stop:
                out.put((rank, step, fits))
                break
        agreement.close()
        notice.close()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("notice_rank", [0, 1])
def test_ranks_agree_on_the_stop_step(notice_rank):
    from tests.support.procs import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, notice_rank, 4, out)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    got = sorted(out.get(timeout=5) for _ in range(2))
    # Notice during step 4 -> in the reduction started after step 4 -> read after step 5.
    assert got == [(0, 5, True), (1, 5, True)]
