"""What a step's agreement decides (`pipeline.train.agreement.decide`), against a hand-written table.

Each expected list is written from the loop's rules, not computed: log when the agreement holds
the window's sums, the dev loss when it holds dev sums, then an early stop, then a stop for a
preemption notice (a synchronous checkpoint first if the grace left covers what still has to run;
nothing after it), then a checkpoint on an early stop, every `checkpoint.interval_steps` and at the
last step, or on rank 0's time-based wish.
"""

from __future__ import annotations

import pytest
import torch

from pipeline.config import CheckpointSection, MetricsSection
from pipeline.train.agreement import NO_NOTICE, Action, Agreed, Cadence, decide
from pipeline.train.loop import LoopState, StepResult

LOG, DEV, EARLY, CKPT = Action.LOG, Action.DEV_LOSS, Action.EARLY_STOP, Action.CHECKPOINT
PREEMPT_SAVED, PREEMPT = Action.STOP_PREEMPTED_AFTER_CHECKPOINT, Action.STOP_PREEMPTED

# Logs every 10 steps, validates every 50, checkpoints every 100 and at the last step, 1005.
CADENCE = Cadence(1005, MetricsSection(log_interval_steps=10, val_loss_interval_steps=50),
                  CheckpointSection(interval_steps=100, interval_s=600.0), validates=True)


def agreed(log: bool = False, dev: bool = False, checkpoint_due: bool = False, grace_left_s: float = NO_NOTICE,
           step_and_save_s: float = 0.0, save_s: float = 0.0, lagged: bool = False) -> Agreed:
    """An agreed row: sums present on log / validation steps, a notice when `grace_left_s` is set."""
    return Agreed(log_sums=[12.0, 10.0] if log else None, dev_sums=[30.0, 25.0, 8.0] if dev else None,
                  checkpoint_due=checkpoint_due, stop=False, grace_left_s=grace_left_s,
                  step_and_save_s=step_and_save_s, save_s=save_s, lagged=lagged)


CASES = {
    # name: (step, agreed row, early-stop verdict, the actions in order)
    "nothing due, no agreement read yet": (1, None, False, []),
    "nothing due, an ordinary step's lagged row": (7, agreed(lagged=True), False, []),
    "a log step": (10, agreed(log=True), False, [LOG]),
    "a validation step (it logs too)": (50, agreed(log=True, dev=True), False, [LOG, DEV]),
    "an interval checkpoint": (100, agreed(log=True, dev=True), False, [LOG, DEV, CKPT]),
    "the last step checkpoints": (1005, agreed(log=True, dev=True), False, [LOG, DEV, CKPT]),
    "rank 0's time-based wish, agreed": (30, agreed(log=True, checkpoint_due=True), False, [LOG, CKPT]),
    "an early stop forces a checkpoint": (150, agreed(log=True, dev=True), True, [LOG, DEV, EARLY, CKPT]),
    "an early stop at an interval step: one checkpoint": (200, agreed(log=True, dev=True), True,
                                                          [LOG, DEV, EARLY, CKPT]),
    # Lagged: the step since and a save must fit (20 - 5 > 0).
    "a preemption stop that fits": (7, agreed(grace_left_s=20.0, step_and_save_s=5.0, save_s=1.0, lagged=True),
                                    False, [PREEMPT_SAVED]),
    # Lagged: 4 - 5 < 0, though the save alone (1 s) would fit.
    "a preemption stop that does not fit": (7, agreed(grace_left_s=4.0, step_and_save_s=5.0, save_s=1.0,
                                                      lagged=True), False, [PREEMPT]),
    # Sent at this step (a log step): the save alone must fit (4 - 1 > 0).
    "a preemption stop sent now fits with the save alone": (
        20, agreed(log=True, grace_left_s=4.0, step_and_save_s=5.0, save_s=1.0), False, [LOG, PREEMPT_SAVED]),
    # 2 - 2 = 0: no grace left after the save.
    "a preemption stop with exactly no grace left does not fit": (
        20, agreed(log=True, grace_left_s=2.0, step_and_save_s=3.0, save_s=2.0), False, [LOG, PREEMPT]),
    "a preemption stop at an interval step: no other checkpoint": (
        100, agreed(log=True, dev=True, grace_left_s=1.0, step_and_save_s=3.0, save_s=2.0), False,
        [LOG, DEV, PREEMPT]),
    "an early stop, then a preemption stop that fits": (
        150, agreed(log=True, dev=True, grace_left_s=30.0, step_and_save_s=3.0, save_s=2.0), True,
        [LOG, DEV, EARLY, PREEMPT_SAVED]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_decide(name):
    step, row, early_stop, expected = CASES[name]
    assert decide(row, step, CADENCE, early_stop) == expected


def test_advance_counts_a_step_in_the_window_and_the_progress():
    state = LoopState()
    state.begin()
    for loss in (3.0, 2.0):
        state.advance(StepResult(loss=torch.tensor(loss), nll=torch.tensor(loss - 1), lr=1e-3, grad_norm=None,
                                 src_tokens=40, tgt_tokens=50, started=0.0))
    p, w = state.progress, state.window
    assert (p.step, p.step_in_epoch, p.tokens_src, p.tokens_tgt) == (2, 2, 80, 100)
    assert (w.steps, w.tokens_tgt, float(w.loss), float(w.nll)) == (2, 100, 5.0, 3.0)
    assert p.train_time_s >= 0.0
