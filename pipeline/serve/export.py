"""``export``: the averaged model as a Hugging Face ``MarianMTModel`` folder and CTranslate2 models.

The conversion itself (the exact mapping of our Transformer onto Marian, CTranslate2's converter)
is the shared library's ``pipeline/decoding/conversion.py``; this stage runs it on the averaged
model. Writes under the stage dir: ``hf/`` (config.json, generation_config.json, model.safetensors,
MarianTokenizer's source.spm, target.spm, vocab.json, tokenizer_config.json), ``ct2-float32/``
and ``ct2-int8/`` (model.bin, config.json, shared_vocabulary.json). All three are logged as
artifacts of the stage's MLflow run. A model with an option after 2017 (pre-norm, RMSNorm, SwiGLU,
rotary) gets its CTranslate2 models only, built from its weights: the manifest's ``hf_not_exported``
says why Marian cannot hold it (``unexportable``). A model CTranslate2 is not given
(``ct2_unexportable``: Table 3 rows A, B, E) is not exported, and the manifest says why.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Any

from model import ModelConfig
from pipeline import storage
from pipeline.decoding.conversion import ct2_unexportable, export_all, unexportable
from pipeline.stage import StageContext, StageResult

log = logging.getLogger(__name__)


def run(ctx: StageContext) -> StageResult:
    avg, vocab = ctx.inputs["average"].outputs, ctx.inputs["vocab"].outputs
    mc = ModelConfig.from_dict(avg["model_config"])
    reason = ct2_unexportable(mc)
    if reason is not None:
        # Not an error: translate (torch backend) and score still run on such a variant; the
        # manifest says why nothing was written, and the CTranslate2 backend refuses it by name.
        log.warning("export: not exported: %s", reason)
        return StageResult(outputs={"model_config": avg["model_config"], "not_exported": reason},
                           metrics={"export/MiB": 0.0})
    with tempfile.TemporaryDirectory() as tmp:
        model_path = str(storage.local_copy(avg["model"]))
        spm_path = str(storage.local_copy(vocab["model"]))
        local = export_all(model_path, avg["model_config"], spm_path, Path(tmp) / "export")
        outputs: dict[str, Any] = {"model_config": avg["model_config"], "averaged": avg.get("averaged", [])}
        if "hf" not in local:  # register's pyfunc needs the Marian folder: it says why there is none
            outputs["hf_not_exported"] = unexportable(mc)
            log.warning("export: CTranslate2 models only, no Hugging Face folder: %s", outputs["hf_not_exported"])
        num_bytes = 0
        for name, folder in local.items():
            dest = storage.absolute(storage.join(ctx.out_dir, Path(folder).name))
            storage.upload(folder, dest)
            num_bytes += sum(f.stat().st_size for f in Path(folder).iterdir())
            outputs[name] = dest
            try:
                ctx.tracker.log_artifact(folder, "export")  # a folder lands as export/<its name>
            except Exception:  # noqa: BLE001 - tracking must not fail a finished export
                log.warning("could not log %s to the tracker", folder, exc_info=True)
        log.info("export: wrote %s (%.1f MiB)", ", ".join(outputs[k] for k in local), num_bytes / 2**20)
    return StageResult(outputs=outputs, metrics={"export/MiB": num_bytes / 2**20})
