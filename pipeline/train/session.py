"""The loop's view of whoever runs it: Ray Train in the stage, or the test/benchmark process.

A `Session` knows this worker's rank, the world size and its device, hands out the latest
registered checkpoint, and takes reports (metrics, optionally a checkpoint folder). The loop
talks to nothing else, so the same `Trainer` runs under Ray Train (`RaySession`) and in-process
(`LocalSession`), and a wrapper can stand between them: tests inject faults that way
(`tests/support/faults.py`), installed through `LoopSpec.session_wrapper`, never through
switches inside the loop.
"""

from __future__ import annotations

import contextlib
import importlib
import shutil
import time
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterator, Protocol

import torch
import torch.distributed as dist

from pipeline.train import checkpoint as train_checkpoint

# "module:function[:argument]": the driver copies it into `LoopSpec.session_wrapper`, and every
# worker calls `function(session, argument)` for the session it trains with (see `wrap`).
SESSION_WRAPPER_ENV = "TRANSFORMER_REPRO_SESSION_WRAPPER"


class Session(Protocol):
    """The loop's view of its runner (Ray Train or a test)."""

    rank: int
    world_size: int
    device: torch.device

    # A wrapper's hook, called with the step's number before each step (tests and benchmarks inject
    # faults and stamps there, `wrap`); None on the plain sessions: an ordinary step calls nothing.
    before_step: Callable[[int], None] | None

    def latest_checkpoint(self) -> ContextManager[str | None]: ...
    def report(self, metrics: dict[str, Any], checkpoint_dir: str | None, dir_name: str | None,
               upload_async: bool = False) -> None: ...


class LocalSession:
    """In-process session: checkpoints are stored as `root/<name>`; rank/world from torch.distributed.

    As with Ray Train, a checkpoint reported for an asynchronous upload is the session's to
    delete once stored (here it is moved), and a synchronous one stays the caller's (copied)."""

    before_step: Callable[[int], None] | None = None

    def __init__(self, root: str | Path, device: str = "cpu"):
        self.root = Path(root)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.device = torch.device(device)
        self.reports: list[dict[str, Any]] = []

    def checkpoints(self) -> list[Path]:
        return sorted(p for p in self.root.glob("checkpoint_*") if (p / train_checkpoint.META_FILE).exists())

    @contextlib.contextmanager
    def latest_checkpoint(self) -> Iterator[str | None]:
        found = self.checkpoints()
        yield str(found[-1]) if found else None

    def report(self, metrics: dict[str, Any], checkpoint_dir: str | None, dir_name: str | None,
               upload_async: bool = False) -> None:
        self.reports.append(dict(metrics))
        if checkpoint_dir is not None and self.rank == 0:
            stored = self.root / (dir_name or f"checkpoint_{len(self.reports)}")
            if upload_async:
                shutil.move(checkpoint_dir, stored)
            else:
                shutil.copytree(checkpoint_dir, stored)


class RaySession:
    """The loop's session inside a Ray Train worker (the only part of the loop that imports Ray)."""

    before_step: Callable[[int], None] | None = None

    def __init__(self, validate: bool = False, upload_retry_s: float = 0.0) -> None:
        import ray.train
        import ray.train.torch

        self.validate = validate  # ask Ray Train's asynchronous validation (dev BLEU) per checkpoint
        ctx = ray.train.get_context()
        self.rank, self.world_size = ctx.get_world_rank(), ctx.get_world_size()
        self.device = ray.train.torch.get_device()
        self.upload_retry_s = upload_retry_s  # an object store's outage delays an upload this long (upload.py)

    @contextlib.contextmanager
    def latest_checkpoint(self) -> Iterator[str | None]:
        import ray.train

        checkpoint = ray.train.get_checkpoint()
        if checkpoint is None:
            yield None
            return
        with checkpoint.as_directory() as path:
            yield path

    def report(self, metrics: dict[str, Any], checkpoint_dir: str | None, dir_name: str | None,
               upload_async: bool = False, upload_fn: Any = None) -> None:
        """`ray.train.report`; the upload is `pipeline.train.upload`'s (retried, verified) unless
        `upload_fn` replaces it (Ray's `checkpoint_upload_fn`), for a wrapper that watches or breaks one."""
        import ray.train
        from ray.train import CheckpointUploadMode

        from pipeline.train.upload import ray_upload_fn

        upload_fn = upload_fn or ray_upload_fn(self.upload_retry_s)

        checkpoint = ray.train.Checkpoint.from_directory(checkpoint_dir) if checkpoint_dir else None
        mode = CheckpointUploadMode.ASYNC if upload_async else CheckpointUploadMode.SYNC
        ray.train.report(metrics, checkpoint=checkpoint, checkpoint_dir_name=dir_name if checkpoint else None,
                         checkpoint_upload_mode=mode, checkpoint_upload_fn=upload_fn if checkpoint else None,
                         validation=self.validate and checkpoint is not None)

    def flush_reports(self, timeout_s: float) -> None:
        """Wait (at most `timeout_s`) until the controller has taken this worker's reports: a
        group that stops right after a report would otherwise stop before it is registered."""
        from ray.train.v2._internal.execution.context import get_train_context  # no public API for it

        queue, deadline = get_train_context().get_result_queue(), time.monotonic() + timeout_s
        while not queue.empty() and time.monotonic() < deadline:
            time.sleep(0.1)


def wrap(session: Session, wrapper: str) -> Session:
    """`session` as the wrapper "module:function[:argument]" returns it ("" = unchanged)."""
    if not wrapper:
        return session
    module, _, rest = wrapper.partition(":")
    name, _, argument = rest.partition(":")
    return getattr(importlib.import_module(module), name)(session, argument)
