"""One agreement per step: the only collective a step of the loop issues (besides DDP's own and a
checkpoint report's) is the step's agreement (pipeline/train/agreement.py), and it adds the ranks'
sums, takes rank 0's wishes and the notice's extremes."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pipeline.train import agreement
from pipeline.train.agreement import Local, StepAgreement
from pipeline.train.loop import LocalSession, LoopSpec, Trainer
from tests.support.procs import free_port
from tests.unit.train.test_loop import one_thread, shards, tiny_spec  # noqa: F401 (fixtures)

# Every Python-level collective and point-to-point call of torch.distributed (DDP's gradient
# all-reduce runs in its C++ reducer, below this level).
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast",
               "broadcast_object_list", "barrier", "reduce", "reduce_scatter", "reduce_scatter_tensor",
               "gather", "gather_object", "scatter", "scatter_object_list", "all_to_all", "all_to_all_single",
               "send", "recv", "isend", "irecv", "monitored_barrier")


class RecordingSession(LocalSession):
    """A LocalSession that marks which step is running, so each collective is charged to its step."""

    def __init__(self, root, step: dict):
        super().__init__(root)
        self.step = step

    def before_step(self, step: int) -> None:
        self.step["now"] = step


def _rank(rank: int, port: int, spec: dict, root: str, out) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    step: dict = {"now": 0}
    calls: list[tuple[int, str, str]] = []
    for name in COLLECTIVES:
        original = getattr(dist, name)

        def recording(*a, _original=original, _name=name, **kw):
            if step["now"]:  # inside the loop (its set-up creates groups and DDP broadcasts the weights)
                caller = inspect.stack()[1].frame.f_globals.get("__name__", "?")
                calls.append((step["now"], _name, caller))
            return _original(*a, **kw)

        setattr(dist, name, recording)
    try:
        summary = Trainer(LoopSpec(**spec), RecordingSession(f"{root}/{rank}", step)).run()
        out.put((rank, calls, summary["final_step"], summary["history_train"]))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_each_step_issues_one_collective_the_agreement(shards, tmp_path):
    """Two ranks, 8 steps that log every 2, validate every 3, checkpoint every 4, with the
    preemption notice on: each step's only collective is the agreement's all_gather."""
    spec = tiny_spec(shards, max_steps=8, metrics_log_interval_steps=2, metrics_val_loss_interval_steps=3,
                     checkpoint_interval_steps=4, workers_preemption_grace_s=25.0)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, spec, str(tmp_path), out)) for r in range(2)]
    for p in procs:
        p.start()
    got = sorted(out.get(timeout=150) for _ in range(2))
    for p in procs:
        p.join(30)
    assert [p.exitcode for p in procs] == [0, 0]
    for rank, calls, final_step, history in got:
        assert final_step == 8
        assert [step for step, _, _ in calls] == list(range(1, 9)), (rank, calls)
        assert {(name, caller) for _, name, caller in calls} == {("all_gather", "pipeline.train.agreement")}
    assert [row[0] for row in got[0][3]] == [2.0, 4.0, 6.0, 8.0]  # rank 0 logged every 2 steps


def test_one_process_gives_its_own_values():
    a = StepAgreement(1)
    local = Local(log_sums=torch.tensor([6.0, 3.0]), dev_sums=torch.tensor([1.0, 2.0, 4.0], dtype=torch.float64),
                  checkpoint_due=True, grace_left_s=5.0, step_and_save_s=2.0, save_s=1.5)
    agreed = a.exchange(local, blocking=False)  # one process: nothing to wait for, never lagged
    assert (agreed.log_sums, agreed.dev_sums) == ([6.0, 3.0], [1.0, 2.0, 4.0])
    assert (agreed.checkpoint_due, agreed.stop, agreed.grace_left_s, agreed.save_s, agreed.lagged) == (
        True, False, 5.0, 1.5, False)
    assert a.exchange(Local(), blocking=True).log_sums is None


def test_combining_the_ranks_rows():
    """Sums are added, the wishes are rank 0's, the notice takes the least grace and the longest step."""
    rows = [[1.0, 2.0, 10.0, 20.0, 3.0, 1.0, 0.0, 40.0, 3.0, 1.0],  # log (2), dev (3), checkpoint_due, stop,
            [0.5, 0.25, 5.0, 7.0, 2.0, 0.0, 1.0, 12.0, 4.0, 0.5]]  # grace left, a step + a save, a save
    agreed = agreement._combine(rows, has_log=True, has_dev=True, lagged=True)
    assert agreed.log_sums == [1.5, 2.25] and agreed.dev_sums == [15.0, 27.0, 5.0]
    assert (agreed.stop, agreed.checkpoint_due) == (False, True)  # rank 1's stop wish is not rank 0's
    assert (agreed.grace_left_s, agreed.step_and_save_s, agreed.save_s, agreed.lagged) == (12.0, 4.0, 1.0, True)


def test_every_field_is_exchanged_with_its_reduction():
    """The row names each field of `Local` once, in order, and `Agreed` holds them all (and `lagged`)."""
    names = [name for name, _, _ in agreement.ROW]
    assert names == [f.name for f in dataclasses.fields(Local)]
    assert [*names, "lagged"] == [f.name for f in dataclasses.fields(agreement.Agreed)]
    assert agreement._flat(Local(stop=True, save_s=2.5)) == [0.0] * 5 + [0.0, 1.0, agreement.NO_NOTICE, 0.0, 2.5]
