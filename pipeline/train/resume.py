"""Where an interrupted `train` stage stands, read from its Ray Train run folder (for `--plan`).

The run of cache key K lives in `<storage_path>/K/` (`pipeline.train.driver`). Ray Train V2 keeps
`checkpoint_manager_snapshot.json` there and, when a `TorchTrainer` with the same
`RunConfig(name, storage_path)` starts again, restores the snapshot's `latest_checkpoint_result`:
that checkpoint is where the workers resume. Reading it needs neither Ray nor torch, so `--plan`
stays fast.
"""

from __future__ import annotations

import json
from typing import Any

from pipeline import storage
from pipeline.config import Config

SNAPSHOT = "checkpoint_manager_snapshot.json"  # Ray Train V2's name (ray.train.v2 StorageContext)
META_FILE = "meta.json"  # pipeline.train.checkpoint.META_FILE, written last (not imported: torch)


def storage_path_for(cfg: Config) -> str:
    return storage.absolute(cfg.run.storage_path or storage.join(cfg.run.work_dir, "ray_train"))


def run_dir_for(cfg: Config, key: str) -> str:
    return storage.join(storage_path_for(cfg), key)


def latest_checkpoint(cfg: Config, key: str) -> dict[str, Any] | None:
    """The checkpoint a rerun of run `key` resumes from: {"name", "step"}; None when there is none.

    A checkpoint counts only if Ray Train registered it (it is the snapshot's latest) and its
    folder is complete (meta.json is written last)."""
    run_dir = run_dir_for(cfg, key)
    try:
        snapshot = json.loads(storage.read_text(storage.join(run_dir, SNAPSHOT)))
    except (FileNotFoundError, OSError, ValueError):
        return None
    latest = snapshot.get("latest_checkpoint_result") or {}
    name = latest.get("checkpoint_dir_name")
    if not name:
        return None
    try:
        meta = json.loads(storage.read_text(storage.join(run_dir, name, META_FILE)))
    except (FileNotFoundError, OSError, ValueError):
        return None
    return {"name": name, "step": int(meta["step"])}


def resume_point(cfg: Config, key: str) -> tuple[str, float] | None:
    """For the plan: (what a rerun does, when the partial run last wrote), or None when the run
    `key` never started."""
    run_dir = run_dir_for(cfg, key)
    when = storage.last_modified(run_dir)
    if when is None:
        return None
    ckpt = latest_checkpoint(cfg, key)
    if ckpt is None:
        return "will start from step 0 (no checkpoint was registered)", when
    return f"will resume from step {ckpt['step']} (checkpoint {ckpt['name']})", when
