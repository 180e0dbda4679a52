"""The checkpoint folder of the `train` stage (docs/stages.md), written and read by the loop
(its `Checkpointer`).

    model.pt        the model's state_dict, tensors on CPU (`average` and `translate` read it);
                    tied tensors (the shared embedding) are stored once
    train_state.pt  optimizer, scheduler, grad scaler, step, data position (epoch, step index in
                    the epoch), token counters, RNG states, metric history, early stop: tensors and plain
                    types only, so that `torch.load(weights_only=True)` reads it. The RNG
                    states are rank 0's, kept for inspection: resume does not need them because
                    the loop re-seeds dropout every step from (seed, rank, step).
    meta.json       {"step", "model_config"}, written last

Ray Train uploads the folder and registers it only after `ray.train.report` returns; a folder a
crash leaves half-uploaded is never registered, so never restored nor listed in the outputs.

`Checkpointer` writes and restores (which steps checkpoint: `pipeline.train.agreement.Cadence`).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from pipeline.config import CheckpointSection

log = logging.getLogger(__name__)

MODEL_FILE = "model.pt"
STATE_FILE = "train_state.pt"
META_FILE = "meta.json"
FILES = (MODEL_FILE, STATE_FILE, META_FILE)


def checkpoint_dir_name(step: int) -> str:
    """Sortable folder name of the checkpoint at `step`."""
    return f"checkpoint_{step:07d}"


@dataclass(kw_only=True)
class Progress:
    """Where training stands: restored from a checkpoint, continued from there."""

    step: int = 0  # optimizer steps done
    epoch: int = 0  # epoch of the next step
    step_in_epoch: int = 0  # index of the next step in that epoch's plan
    tokens_src: int = 0  # non-pad source tokens trained on (all workers)
    tokens_tgt: int = 0  # target tokens trained on (all workers)
    train_time_s: float = 0.0  # wall time in the loop, summed over attempts (up to each checkpoint)
    world_size: int = 0  # workers of the attempt that wrote the checkpoint (0: not recorded)
    # Learning curves for the plots: [step, loss, nll, lr] per log line, [step, loss, nll] per eval.
    history_train: list[list[float]] = field(default_factory=list)
    history_val: list[list[float]] = field(default_factory=list)
    # Set when early stopping ended the run (pipeline.train.early_stop.EarlyStop.record): a
    # resumed run that finds it ends at once.
    early_stop: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def cpu_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state_dict on CPU, each tensor copied once: keys that share a tensor (the three-way
    tied embedding) still share one copy, so `torch.save` writes it once (it stores storages,
    not keys) and a loaded dict keeps the sharing. A naive per-key copy tripled the embedding
    (base: 385 MiB instead of 241 MiB)."""
    copies: dict[tuple[int, int, tuple[int, ...]], torch.Tensor] = {}
    out = {}
    for k, v in model.state_dict().items():
        ident = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape))
        if ident not in copies:
            copies[ident] = v.detach().to("cpu", copy=True)
        out[k] = copies[ident]
    return out


def rng_state() -> dict[str, Any]:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    return {"torch": torch.get_rng_state(), "cuda": list(cuda)}


def save(path: str | Path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
         scheduler: Any, scaler: Any, progress: Progress, model_config: dict[str, Any],
         extra: dict[str, Any] | None = None) -> None:
    """Write the three files into the (empty, local) folder `path`; meta.json last."""
    path = Path(path)
    torch.save(cpu_state_dict(model), path / MODEL_FILE)
    state = {
        **progress.to_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "scaler": scaler.state_dict() if scaler is not None and scaler.is_enabled() else {},
        "rng": rng_state(),
        **(extra or {}),
    }
    torch.save(state, path / STATE_FILE)
    tmp = path / f".{META_FILE}.tmp"
    tmp.write_text(json.dumps({"step": progress.step, "model_config": model_config}, indent=2) + "\n")
    os.replace(tmp, path / META_FILE)


def load(path: str | Path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
         scheduler: Any, scaler: Any, device: torch.device) -> Progress:
    """Restore model, optimizer, scheduler and scaler in place; return the saved `Progress`."""
    path = Path(path)
    missing = [f for f in FILES if not (path / f).exists()]
    if missing:
        raise FileNotFoundError(f"checkpoint {path} lacks {', '.join(missing)}")
    model.load_state_dict(torch.load(path / MODEL_FILE, map_location=device, weights_only=True))
    state = torch.load(path / STATE_FILE, map_location=device, weights_only=True)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    if scaler is not None and scaler.is_enabled() and state.get("scaler"):
        scaler.load_state_dict(state["scaler"])
    known = Progress.__dataclass_fields__
    return Progress(**{k: v for k, v in state.items() if k in known})


def report(session: Any, step: int, metrics: dict[str, Any], upload_async: bool,
           write: Callable[[str], None]) -> None:
    """Rank 0 writes the checkpoint of `step` (`write(folder)`) into a fresh local folder and
    reports it; the other ranks report without one (Ray Train's report is also a barrier).

    Async upload: Ray Train uploads in a background thread, registers the checkpoint only once
    it is complete, deletes the folder afterwards, and waits for the upload before the run
    ends; so a crash mid-upload leaves the previous checkpoint as the latest."""
    name = checkpoint_dir_name(step)
    if session.rank != 0:
        session.report(metrics, None, None, upload_async)
        return
    tmp = tempfile.mkdtemp(prefix=f"{name}-")
    try:
        write(tmp)
        session.report(metrics, tmp, name, upload_async)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if not upload_async:
        shutil.rmtree(tmp, ignore_errors=True)


class Checkpointer:
    """One worker's checkpoints in the loop: the latest one restored (`restore`), a new one written
    by rank 0 and reported by every rank (`write`).

    `state` holds what a checkpoint keeps besides the progress: the model, optimizer, scheduler
    and scaler (the keyword arguments of `save` and `load`)."""

    def __init__(self, session: Any, rank: int, device: torch.device, checkpoint: CheckpointSection,
                 state: dict[str, Any], max_steps: int, model_config: dict[str, Any], extra: dict[str, Any]):
        self.session, self.rank, self.device, self.checkpoint = session, rank, device, checkpoint
        self.state, self.max_steps, self.model_config, self.extra = state, max_steps, model_config, extra

    def restore(self) -> Progress | None:
        """The progress of the latest checkpoint, whose state is loaded in place; None: there is none."""
        with self.session.latest_checkpoint() as path:
            if path is None:
                return None
            p = load(path, **self.state, device=self.device)
        if self.rank == 0:
            log.info("resumed from checkpoint at step %d (epoch %d, step %d of that epoch)",
                     p.step, p.epoch, p.step_in_epoch)
        return p

    def write(self, p: Progress, metrics: dict[str, Any], sync: bool = False) -> float:
        """The checkpoint of `p.step` (reported with `metrics`); the seconds the loop waited (`sync`:
        the upload included)."""
        t0 = time.perf_counter()
        upload_async = self.checkpoint.upload == "async" and not sync
        report(self.session, p.step, {"step": p.step, "epoch": p.epoch, **metrics}, upload_async,
               lambda folder: save(folder, **self.state, progress=p, model_config=self.model_config,
                                   extra=self.extra))
        waited = time.perf_counter() - t0
        if self.rank == 0:
            log.info("step %d/%d | checkpoint %s (%s upload; the loop waited %.2f s)", p.step, self.max_steps,
                     checkpoint_dir_name(p.step), "background" if upload_async else "synchronous", waited)
        return waited
