"""A dev-BLEU validation that shares the training's CPU cores decodes in the time training leaves."""

from __future__ import annotations

import os
import threading

import pytest

from pipeline.train.dev_bleu_task import yielding_cpu

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")


def _policy_of_a_new_thread() -> int:
    """The policy a thread started now gets (the decoder's threads are started inside the task)."""
    seen = []
    t = threading.Thread(target=lambda: seen.append(os.sched_getscheduler(0)))
    t.start()
    t.join()
    return seen[0]


def test_within_it_this_thread_and_the_threads_it_starts_run_at_sched_idle_then_not():
    before = os.sched_getscheduler(0)
    assert before != os.SCHED_IDLE
    with yielding_cpu(True):
        assert os.sched_getscheduler(0) == os.SCHED_IDLE
        assert _policy_of_a_new_thread() == os.SCHED_IDLE
    assert os.sched_getscheduler(0) == before
    with yielding_cpu(False):
        assert os.sched_getscheduler(0) == before


def test_the_task_yields_only_where_it_holds_no_cpu_of_its_own():
    from pipeline.config import load_config
    from pipeline.train.dev_bleu_validation import shares_training_cores

    def yields(resources: str) -> bool:
        return shares_training_cores(load_config(None, [f"--dev_bleu.resources={resources}"]))

    assert yields("CPU=0") and not yields("CPU=1") and not yields("GPU=1,CPU=0")
