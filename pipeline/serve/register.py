"""``register``: the scored model as a version of the MLflow Model Registry (after ``score``).

One registered model per language pair and size (``transformer-base-en-de``, ``transformer-big-en-fr``;
a size that is neither Table 3 base nor big is ``custom``), one version per export output: the
same export output registered again (``score`` rerun after a decoding change) updates that
version's tags and adds none; ``--force`` of train / average / export writes a new export output,
hence a new version. A cached register stage registers nothing.

Why a stage of its own after ``score`` and not the end of ``export``: a version carries the test
BLEU/chrF as tags, which exist only after ``score``, and registering in ``export`` would leave
versions without scores or need ``score`` to write into the registry as well.

The version's files (an MLflow pyfunc model, ``marian_pyfunc.py``): ``artifacts/hf`` (the export
stage's Marian folder), ``artifacts/ours`` (model.pt, model_config.json, spm.model: what
``serve run ... model=models:/...`` loads for our beam search; text.json, the training text's
format, ``pipeline/decoding/text.py``), ``artifacts/ct2-float32`` and
``ct2-int8`` (CTranslate2), ``artifacts/decode.json`` (the run's decode settings). Tags: the stage
keys, the test scores, the decode settings and the resolved config (JSON). The source run is the
register stage's MLflow run (a nested run of the workflow's parent run).
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from dataclasses import asdict
from importlib import metadata
from pathlib import Path
from typing import Any

from pipeline import registry, storage
from pipeline.config import DecodeSettings
from pipeline.decoding.scoring import setup_of
from pipeline.decoding.text import TextFormat
from pipeline.stage import StageContext, StageResult

log = logging.getLogger(__name__)

PYFUNC = Path(__file__).with_name("marian_pyfunc.py")
MODEL_PACKAGE = Path(__file__).resolve().parents[2] / "model"  # the pyfunc's code path (output_budget)
# The version's input example: MLflow translates it when saving (a model that cannot translate shows
# as an MLflow warning in the register log, not at the first request) and stores it beside the
# signature it infers from MarianTranslation.predict's type hints.
INPUT_EXAMPLE = ["The cat sat on the mat.", "Where is the nearest train station?"]


def model_name(cfg: Any) -> str:
    """``transformer-<base|big|custom>-<src>-<tgt>``."""
    return f"transformer-{setup_of(cfg)['size'] or 'custom'}-{cfg.data.src_lang}-{cfg.data.tgt_lang}"


def _requirements() -> list[str]:
    """Pinned to what made the version (MLflow would otherwise infer them by loading the model)."""
    return [f"{p}=={metadata.version(p)}" for p in ("mlflow", "torch", "transformers", "sentencepiece",
                                                      "ctranslate2", "sacremoses")]


def build_pyfunc(folder: Path, files: dict[str, str], model_config: dict[str, Any], decode: dict[str, Any],
                 text: dict[str, str] | None = None) -> Path:
    """The MLflow pyfunc model folder under ``folder`` (``files``: hf, model, spm, ct2-* URIs)."""
    import mlflow

    ours = folder / registry.OURS
    ours.mkdir(parents=True)
    shutil.copyfile(storage.local_copy(files["model"]), ours / "model.pt")
    shutil.copyfile(storage.local_copy(files["spm"]), ours / "spm.model")
    (ours / "model_config.json").write_text(json.dumps(model_config))
    (ours / "text.json").write_text(json.dumps(text or {}))
    (folder / "decode.json").write_text(json.dumps(decode))
    artifacts = {"hf": str(storage.local_copy(files["hf"])), registry.OURS: str(ours),
                 "decode": str(folder / "decode.json"), "text": str(ours / "text.json"),
                 **{k: str(storage.local_copy(v)) for k, v in files.items() if k.startswith("ct2-")}}
    out = folder / "model"
    mlflow.pyfunc.save_model(str(out), python_model=str(PYFUNC), artifacts=artifacts,
                             code_paths=[str(MODEL_PACKAGE)], pip_requirements=_requirements(),
                             input_example=INPUT_EXAMPLE)
    return out


def run(ctx: StageContext) -> StageResult:
    avg, vocab = ctx.inputs["average"], ctx.inputs["vocab"]
    export, score = ctx.inputs["export"], ctx.inputs["score"]
    if not ctx.tracker.run_id:
        log.warning("register: tracking is off (tracking.enabled = false): nothing registered")
        return StageResult(outputs={"registered": False, "reason": "tracking.enabled = false"})
    if "not_exported" in export.outputs:
        log.warning("register: not registered: %s", export.outputs["not_exported"])
        return StageResult(outputs={"registered": False, "reason": export.outputs["not_exported"]})
    if "hf" not in export.outputs:  # the pyfunc wraps the Marian folder
        reason = f"no Hugging Face folder ({export.outputs.get('hf_not_exported', 'not exported')})"
        log.warning("register: not registered: %s", reason)
        return StageResult(outputs={"registered": False, "reason": reason})
    name = model_name(ctx.cfg)
    identity = {"train_key": avg.extra.get("upstream_keys", {}).get("train", ""), "average_key": avg.key,
                "export_key": export.key, "export_finished": export.extra.get("finished", "")}
    decode = asdict(DecodeSettings.of(ctx.cfg.decode))
    tags = {"score_key": score.key, "work_dir": storage.absolute(ctx.cfg.run.work_dir),
            "config": json.dumps(ctx.cfg.to_dict(), sort_keys=True, separators=(",", ":")),
            **{f"decode.{k}": v for k, v in decode.items()},
            **{f"{split}/{k}": v for split, s in score.outputs["scores"].items() for k, v in s.items()}}
    files = {"model": avg.outputs["model"], "spm": vocab.outputs["model"], "hf": export.outputs["hf"],
             **{f"ct2-{k[len('ct2_'):]}": v for k, v in export.outputs.items() if k.startswith("ct2_")}}
    setup = setup_of(ctx.cfg)
    description = (f"Transformer (Vaswani et al., 2017), {setup['size'] or 'custom size'}, {setup['pair']}: "
                   "pyfunc on the Hugging Face Marian folder; our model.pt + spm.model; CTranslate2 float32/int8")
    with tempfile.TemporaryDirectory() as tmp:
        version, created = registry.register_version(
            ctx.tracker.tracking_uri, ctx.tracker.run_id, name,
            lambda: build_pyfunc(Path(tmp), files, avg.outputs["model_config"], decode,
                                 TextFormat.of_config(ctx.cfg).to_dict()), identity, tags, description)
    uri = f"models:/{name}/{version}"
    log.info("register: %s (%s)", uri, "new version" if created else "existing version, tags updated")
    return StageResult(outputs={"registered": True, "registered_model": name, "version": str(version),
                                "model_uri": uri, "created": created})
