"""``average``: the element-wise mean of N training checkpoints (§6.1: the last 5 for base).

``average.select`` says which N (``pipeline.decoding.selection``): "last" (the paper's), or
"best_dev_bleu": the N kept checkpoints with the highest dev sacreBLEU. Their scores come from the
train run's dev BLEU records (``pipeline.decoding.dev_bleu_records``, made while it trained) when they
were made with this config's dev BLEU settings; a kept checkpoint without one (skipped, failed,
other settings, or dev BLEU off) is scored here, in-process, and its record written beside the
others. ``averaged.json`` lists every kept checkpoint's dev BLEU and whether it was averaged.

Reads ``train.outputs["checkpoints"]`` (kept checkpoint folders, oldest first; each holds
``model.pt`` and ``meta.json``) and writes ``model.pt`` (the averaged ``state_dict``),
``model_config.json`` and ``averaged.json`` (which checkpoints, at which steps).

Fewer kept checkpoints than ``average.checkpoints`` is an error naming both numbers: the
paper's recipe must not silently turn into "average what happens to be there". A short run
that made fewer checkpoints states that in its config (``--average.checkpoints=K``), which is
part of this stage's cache key and so recorded with the result.
"""

from __future__ import annotations

import io
import logging
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from model import ModelConfig, average_checkpoints
from pipeline import storage
from pipeline.config import Config
from pipeline.decoding import dev_bleu, dev_bleu_records
from pipeline.decoding.selection import select_best, select_last
from pipeline.stage import StageContext, StageResult

log = logging.getLogger(__name__)


def dev_scores(cfg: Config, train: dict[str, Any], checkpoints: list[str]) -> dict[str, dict[str, Any]]:
    """checkpoint uri -> its dev BLEU record under this config's settings, scoring the missing ones."""
    dev = train.get("dev_bleu") or {}
    run_dir = dev.get("run_dir") or storage.join(train["storage_path"], train["run_name"])
    settings = dev_bleu.DevBleuSettings.from_config(cfg)
    known = dev_bleu_records.scores_for(dev_bleu_records.read_records(run_dir), settings)
    out = {}
    for uri in checkpoints:
        name = uri.rstrip("/").rsplit("/", 1)[-1]
        if name not in known:
            known[name] = _score_here(cfg, dev, run_dir, uri, name, settings)
        out[uri] = known[name]
    return out


def _score_here(cfg: Config, dev: dict[str, Any], run_dir: str, uri: str, name: str,
                settings: dev_bleu.DevBleuSettings) -> dict[str, Any]:
    if not dev.get("dev_dir") or not dev.get("spm"):
        raise ValueError(f"average.select = 'best_dev_bleu': {name} has no dev BLEU with the settings "
                         f"{settings.to_dict()} and the train stage recorded no dev split / SentencePiece "
                         "model to score it with (rerun train with dev_bleu.enabled = true)")
    threads = max(1, torch.get_num_threads())
    log.info("average: scoring %s on dev here (%d threads): train has no dev BLEU for it with %s", name,
             threads, settings.to_dict())
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for f in ("model.pt", "meta.json"):
            storage.upload(storage.local_copy(storage.join(uri, f)), str(Path(tmp) / f))
        result = dev_bleu.score_checkpoint(tmp, dev["dev_dir"], dev["spm"], settings, cfg.data.tgt_lang,
                                           threads=threads, batch_tokens=cfg.decode.batch_tokens,
                                           preprocess=cfg.data.preprocess)
    record = {"checkpoint": name, "step": dev_bleu_records.step_of(name), "settings": settings.to_dict(),
              "status": "validated", "by": "average", **result, "seconds": time.perf_counter() - t0}
    dev_bleu_records.write_record(run_dir, record)
    return record


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
    train, av = ctx.inputs["train"].outputs, ctx.cfg.average
    kept = list(train["checkpoints"])
    scores = {}
    if av.select == "best_dev_bleu":
        select_last(kept, av.checkpoints)  # too few: fail before scoring anything
        scores = dev_scores(ctx.cfg, train, kept)
        chosen = select_best(kept, {u: r["bleu_sacre"] for u, r in scores.items()}, av.checkpoints)
    else:
        chosen = select_last(kept, av.checkpoints)
        known = dev_bleu_records.scores_for((train.get("dev_bleu") or {}).get("records", []),
                                    dev_bleu.DevBleuSettings.from_config(ctx.cfg))
        scores = {u: known[n] for u in kept if (n := u.rstrip("/").rsplit("/", 1)[-1]) in known}
    metas = [_meta(uri) for uri in chosen]
    steps = [m.get("step") for m in metas]
    model_config = train.get("model_config") or metas[-1].get("model_config")
    if not model_config:
        raise ValueError("average: no model_config in train's outputs nor in the checkpoint's meta.json")
    ModelConfig.from_dict(model_config)  # fail here, not in translate, if it is not a valid config
    log.info("averaging %d checkpoint(s) at steps %s (average.select = %s)", len(chosen), steps,
             av.select)
    # Every kept checkpoint's dev BLEU (None: not validated with these settings) for the report.
    table = [{"checkpoint": u, "step": (scores.get(u) or {}).get("step"),
              "dev_bleu_sacre": (scores.get(u) or {}).get("bleu_sacre"), "averaged": u in chosen} for u in kept]

    state = average_files(chosen)
    buf = io.BytesIO()
    torch.save(state, buf)
    model_uri = storage.absolute(storage.join(ctx.out_dir, "model.pt"))
    storage.write_bytes(model_uri, buf.getvalue())
    storage.write_json(storage.join(ctx.out_dir, "model_config.json"), model_config)
    averaged = {"checkpoints": chosen, "steps": steps, "num_averaged": len(chosen),
                "average_last": av.checkpoints, "average_select": av.select, "kept": table}
    storage.write_json(storage.join(ctx.out_dir, "averaged.json"), averaged)
    num_params = sum(t.numel() for t in state.values() if t.is_floating_point())
    log.info("wrote %s (%d parameters, %.1f MiB)", model_uri, num_params, buf.tell() / 2**20)
    return StageResult(
        outputs={"model": model_uri, "model_config": model_config, "averaged": chosen,
                 "steps": steps, "average_select": av.select, "kept": table},
        metrics={"average/num_checkpoints": float(len(chosen))},
    )
