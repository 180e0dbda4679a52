"""``average``: the element-wise mean of the last N training checkpoints (§6.1: N = 5 for base).

Reads ``train.outputs["checkpoints"]`` (kept checkpoint folders, oldest first; each holds
``model.pt`` and ``meta.json``) and writes ``model.pt`` (the averaged ``state_dict``),
``model_config.json`` and ``averaged.json`` (which checkpoints, at which steps).

Fewer kept checkpoints than ``eval.average_last`` is an error naming both numbers: the
paper's recipe must not silently turn into "average what happens to be there". A short run
that made fewer checkpoints states that in its config (``--eval.average_last=K``), which is
part of this stage's cache key and so recorded with the result.
"""

from __future__ import annotations

import io
import logging
from typing import Any

import torch

from model import ModelConfig, average_checkpoints
from pipeline import storage
from pipeline.stage import StageContext, StageResult

log = logging.getLogger(__name__)


def select_checkpoints(checkpoints: list[str], average_last: int) -> list[str]:
    """The last ``average_last`` of ``checkpoints`` (oldest first); too few is a ValueError."""
    if len(checkpoints) < average_last:
        raise ValueError(
            f"eval.average_last = {average_last} but train kept only {len(checkpoints)} "
            f"checkpoint(s) ({', '.join(checkpoints) or 'none'}). §6.1 averages the last 5: train "
            f"longer / keep more (train.keep_checkpoints), or say --eval.average_last={max(len(checkpoints), 1)} "
            f"to average what exists.")
    return list(checkpoints[-average_last:])


def load_state_dict(checkpoint_uri: str) -> dict[str, torch.Tensor]:
    """A checkpoint folder's ``model.pt`` on CPU (tensors only: ``weights_only=True``)."""
    path = storage.local_copy(storage.join(checkpoint_uri, "model.pt"))
    return torch.load(path, weights_only=True, map_location="cpu")


def average_files(checkpoints: list[str]) -> dict[str, torch.Tensor]:
    """Mean of the checkpoints' state dicts (float64 accumulation in ``model.average_checkpoints``)."""
    return average_checkpoints([load_state_dict(uri) for uri in checkpoints])


def _meta(checkpoint_uri: str) -> dict[str, Any]:
    uri = storage.join(checkpoint_uri, "meta.json")
    return storage.read_json(uri) if storage.exists(uri) else {}


def run(ctx: StageContext) -> StageResult:
    train = ctx.inputs["train"].outputs
    chosen = select_checkpoints(list(train["checkpoints"]), ctx.cfg.eval.average_last)
    metas = [_meta(uri) for uri in chosen]
    steps = [m.get("step") for m in metas]
    model_config = train.get("model_config") or metas[-1].get("model_config")
    if not model_config:
        raise ValueError("average: no model_config in train's outputs nor in the checkpoint's meta.json")
    ModelConfig.from_dict(model_config)  # fail here, not in translate, if it is not a valid config
    log.info("averaging %d checkpoint(s) at steps %s", len(chosen), steps)

    state = average_files(chosen)
    buf = io.BytesIO()
    torch.save(state, buf)
    model_uri = storage.absolute(storage.join(ctx.out_dir, "model.pt"))
    storage.write_bytes(model_uri, buf.getvalue())
    storage.write_json(storage.join(ctx.out_dir, "model_config.json"), model_config)
    averaged = {"checkpoints": chosen, "steps": steps, "num_averaged": len(chosen),
                "average_last": ctx.cfg.eval.average_last}
    storage.write_json(storage.join(ctx.out_dir, "averaged.json"), averaged)
    num_params = sum(t.numel() for t in state.values() if t.is_floating_point())
    log.info("wrote %s (%d parameters, %.1f MiB)", model_uri, num_params, buf.tell() / 2**20)
    return StageResult(
        outputs={"model": model_uri, "model_config": model_config, "averaged": chosen,
                 "steps": steps},
        metrics={"average/num_checkpoints": float(len(chosen))},
    )
