"""How many of the project's files one plain training step runs through (no log line, validation or
checkpoint; mid-epoch), on every thread: what a reader follows to see what a step does. Python's
own tracer (`sys.settrace`, `threading.settrace`) records each function call; the test fails when
the count grows past today's, and prints the files."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

from pipeline.train.loop import LocalSession, LoopSpec, Trainer
from tests.support.synthetic import write_reverse_task
from tests.unit.train.test_loop import VOCAB, one_thread, tiny_spec  # noqa: F401 (fixture)

REPO = Path(__file__).resolve().parents[3]
# model/: transformer (§3), compute (its layout and kernels), training (§5: the loss, the lr schedule);
# pipeline/train/: loop, step, feeder, agreement; in the feeder's prefetch thread, the step's split
# over the workers (pipeline/batch_plan/step_groups.py) and its collate (feeder.py).
MAX_FILES = 8
TRACED = range(21, 29)  # steps 21..28 of 40: an epoch of ~60 steps, none logs, validates or checkpoints


def test_a_plain_step_runs_through_few_files(tmp_path, one_thread):
    train = write_reverse_task(tmp_path / "train", 3000, VOCAB, seed=0)
    spec = tiny_spec((train, train), max_steps=40, metrics_log_interval_steps=1000,
                     metrics_val_loss_interval_steps=1000, checkpoint_interval_steps=1000)
    trainer = Trainer(LoopSpec(**{**spec, "dev_dir": ""}), LocalSession(tmp_path / "ck"))
    seen: dict[str, int] = {}
    on = threading.Event()

    def tracer(frame, event, arg):
        path = Path(frame.f_code.co_filename)
        if on.is_set() and event == "call" and path.is_relative_to(REPO) and ".venv" not in path.parts \
                and "tests" not in path.relative_to(REPO).parts:
            key = str(path.relative_to(REPO))
            seen[key] = seen.get(key, 0) + 1

    before_step = trainer.session.before_step

    def switch(step: int) -> None:
        if step in TRACED:
            on.set()
        else:
            on.clear()
        if before_step is not None:
            before_step(step)

    trainer.session.before_step = switch
    sys.settrace(tracer)
    threading.settrace(tracer)  # the prefetch thread starts inside run()
    try:
        out = trainer.run()
    finally:
        sys.settrace(None)
        threading.settrace(None)
    assert out["final_step"] == 40 and out["epoch"] == 0
    files = sorted(seen)
    assert "model/transformer.py" in files and "pipeline/batch_plan/step_groups.py" in files  # both threads
    assert len(files) <= MAX_FILES, f"a plain step runs through {len(files)} files: {files}"
