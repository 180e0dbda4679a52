"""Which trained model to use, the one lookup of the project: ``serve run``, the translate CLI and
``benchmarks/decode_bench.py`` all call ``find_model``. A config's own `ModelConfig` (its sizes at
the vocab stage's vocabulary) is ``model_config_for``'s.

Four ways to name a model, exactly one per call:

- ``config=`` (one or more TOML files, plus the ``--section.key=value`` overrides the run used):
  the DAG's own cache keys for that config (``pipeline.dag.keys_in_work_dir``) name the exact
  ``average``, ``vocab`` and ``export`` outputs under its ``run.work_dir`` (``work_dir=`` replaces
  it: a local path or ``s3://``). Each stage on the way must have finished with that key and be
  current (its recorded upstream manifests are the ones there now); otherwise the error names
  the stage. Nothing is guessed from file times, so a work dir shared by several configs (the
  Table 3 runner) serves the config you named.
- ``run_record=`` (a file ``workflows/reproduce_base.py --record`` wrote; ``make serve``'s
  ``work/last-run.json``): the model of the run that wrote it, found as ``config=`` finds one, with
  the run's resolved config (``pipeline.run_record``), so no override is repeated.
- ``model_uri=models:/<name>/<version>`` or ``models:/<name>@<alias>``: a version of the MLflow
  Model Registry (the ``register`` stage's), downloaded through ``pipeline.registry``.
- explicit paths: ``model_dir`` (an ``average`` output or a checkpoint folder) and ``spm``, and
  ``ct2_model`` for the CTranslate2 backend.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Sequence

from model import ModelConfig
from pipeline import storage
from pipeline.config import Config
from pipeline.dag import BY_NAME, ORDER, keys_in_work_dir, manifest_digest, read_manifest, stage_dir, upstream_closure
from pipeline.stage import MANIFEST, Manifest

log = logging.getLogger(__name__)


# data.* keys of the text the model was trained on (pipeline.decoding.text.TextFormat's fields)
TEXT_KEYS = ("preprocess", "src_lang", "tgt_lang")


def model_config_for(cfg: Config, vocab: dict[str, Any]) -> ModelConfig:
    """The one place where the config's `model` section and the vocab stage's outputs become a
    `ModelConfig`: `cfg.model` sizes + the vocabulary's size and special ids (the train stage,
    --plan's bill, Table 3)."""
    return ModelConfig.of(cfg.model, int(vocab["vocab_size"]), pad_id=int(vocab.get("pad_id", 0)),
                          bos_id=int(vocab.get("bos_id", 2)), eos_id=int(vocab.get("eos_id", 3)))


class ModelNotFound(ValueError):
    """The named model does not exist, or a stage that makes it has not finished: says which."""


@dataclass(kw_only=True)
class ModelFiles:
    """Where one trained model's files are (local paths or URIs)."""

    model: str  # our model.pt (the averaged state dict)
    model_config: dict[str, Any]  # ModelConfig.to_dict()
    spm: str  # the SentencePiece model
    origin: str  # what named it (for logs and GET /health)
    ct2: dict[str, str] = field(default_factory=dict)  # quantization -> CTranslate2 folder
    hf: str = ""  # the Hugging Face Marian folder, when exported
    no_ct2: str = ""  # why there is no CTranslate2 model, when there is none
    ct2_given: str = ""  # an explicit CTranslate2 folder (ct2_model=...), whatever its quantization
    # the text the model was trained on (pipeline.decoding.text.TextFormat: data.preprocess, languages)
    text: dict[str, str] = field(default_factory=dict)
    # its score stage's numbers per split, when known (a config whose score stage finished, or a
    # registry version's tags): the Serve page states them beside the model
    scores: dict[str, dict[str, Any]] = field(default_factory=dict)

    def ct2_model(self, quantization: str) -> str:
        if self.ct2_given:
            return self.ct2_given
        if quantization not in self.ct2:
            raise ModelNotFound(f"{self.origin}: no CTranslate2 {quantization} model "
                                f"({self.no_ct2 or 'not exported'}); use backend=torch")
        return self.ct2[quantization]


def find_model(*, config: Sequence[str] = (), overrides: Sequence[str] = (), work_dir: str = "",
               run_record: str = "", model_uri: str = "", tracking_uri: str = "", model_dir: str = "",
               spm: str = "", ct2_model: str = "", download_dir: str | None = None) -> ModelFiles:
    """The model named by exactly one of ``config``, ``run_record``, ``model_uri`` or ``model_dir``
    + ``spm`` (a registry version is downloaded into ``download_dir``, default a new temporary folder)."""
    named = [n for n, v in (("config", config), ("run_record", run_record), ("model", model_uri),
                            ("model_dir", model_dir)) if v]
    if len(named) != 1:
        raise ModelNotFound(f"name one model: config=..., run_record=..., model=models:/..., or model_dir=... "
                            f"spm=... (got {', '.join(named) or 'none'}"
                            f"{'; work_dir alone names no model: add the config=... it ran with' if work_dir else ''})")
    if config:
        from pipeline.config import load_config

        cfg = load_config(list(config), [*overrides, *([f"--run.work_dir={work_dir}"] if work_dir else [])])
        return from_config(cfg, f"config {', '.join(config)}")
    if run_record:
        return from_run_record(run_record, work_dir)
    if model_uri:
        return from_registry(model_uri, tracking_uri, download_dir)
    if not spm:
        raise ModelNotFound(f"model_dir={model_dir}: give spm=... (the vocab stage's spm.model) as well")
    files = from_model_dir(model_dir, spm)
    files.ct2_given = ct2_model
    return files


def from_model_dir(model_dir: str, spm: str) -> ModelFiles:
    """``model.pt`` + config from an ``average`` output dir or a train checkpoint dir; the text
    format from the average stage's manifest (its resolved config) where there is one."""
    cfg_uri, meta_uri = storage.join(model_dir, "model_config.json"), storage.join(model_dir, "meta.json")
    if storage.exists(cfg_uri):
        model_config = storage.read_json(cfg_uri)
    elif storage.exists(meta_uri):
        model_config = storage.read_json(meta_uri)["model_config"]
    else:
        raise ModelNotFound(f"{model_dir}: neither model_config.json (average) nor meta.json (checkpoint)")
    text: dict[str, str] = {}
    manifest_uri = storage.join(model_dir, MANIFEST)
    if storage.exists(manifest_uri):
        data = storage.read_json(manifest_uri).get("extra", {}).get("resolved_config", {}).get("data", {})
        text = {k: data[k] for k in TEXT_KEYS if k in data}
    return ModelFiles(model=storage.join(model_dir, "model.pt"), model_config=model_config, spm=spm, origin=model_dir,
                      text=text)


def finished_stages(cfg: Any, names: Sequence[str], origin: str,
                    known: dict[str, Manifest] | None = None) -> dict[str, Manifest]:
    """The manifests of ``names`` (and of every stage they read) at ``cfg``'s keys, each finished
    and current, or the error naming the first stage that is not (not run with this config, or
    stale: an upstream stage was rerun after it); ``known``: ones already found so (not read again)."""
    keys = keys_in_work_dir(cfg)
    wanted = set(names).union(*(upstream_closure(n) for n in names))
    out: dict[str, Manifest] = dict(known or {})
    for name in [n for n in ORDER if n in wanted and n not in out]:
        where = stage_dir(cfg, name, keys[name])
        m = read_manifest(where, keys[name])
        if m is None:
            raise ModelNotFound(f"{origin}: stage '{name}' has not finished for this config (no {MANIFEST} "
                                f"under {where}); run the workflow with this config (and the same "
                                f"--section.key=value overrides) first")
        recorded = m.extra.get("upstream_digests", {})
        stale = [u for u in BY_NAME[name].upstream if recorded.get(u) != manifest_digest(out[u])]
        if stale:
            raise ModelNotFound(f"{origin}: stage '{name}' (key {keys[name]}) is stale: upstream "
                                f"{', '.join(stale)} was rerun since it ran; rerun the workflow")
        out[name] = m
    return out


def from_config(cfg: Any, origin: str) -> ModelFiles:
    """The ``average`` / ``vocab`` outputs of this config's plan, and its ``export``'s if finished."""
    found = finished_stages(cfg, ["average"], origin)
    avg, vocab = found["average"], found["vocab"]
    files = ModelFiles(model=avg.outputs["model"], model_config=avg.outputs["model_config"], spm=vocab.outputs["model"],
                       origin=f"{origin} (average {avg.key})",
                       text={k: getattr(cfg.data, k) for k in TEXT_KEYS})
    log.info("model of %s: %s", origin, avg.dir)
    try:
        score = finished_stages(cfg, ["score"], origin, found)["score"].outputs
        files.scores = {split: {k: float(v) for k, v in vals.items() if isinstance(v, (int, float))}
                        for split, vals in score.get("scores", {}).items()}  # numbers, as a registry version's
    except ModelNotFound:
        pass  # not scored (yet): the page says so
    try:
        export = finished_stages(cfg, ["export"], origin, found)["export"].outputs
    except ModelNotFound as e:  # the torch backend does not need it; asking for CTranslate2 says why
        files.no_ct2 = str(e)
        return files
    files.no_ct2 = export.get("not_exported", "")
    files.ct2 = {k[len("ct2_"):]: v for k, v in export.items() if k.startswith("ct2_")}
    files.hf = export.get("hf", "")
    return files


def from_run_record(path: str, work_dir: str = "") -> ModelFiles:
    """The model of the run that wrote the record at ``path`` (``work_dir``: where its work dir is now)."""
    from pipeline import run_record

    try:
        record = run_record.read(path)
    except run_record.NoRunRecord as e:
        raise ModelNotFound(str(e)) from None
    if work_dir:
        record.config.run.work_dir = work_dir
    return from_config(record.config, f"the run of {record.command} (recorded in {path})")


def from_registry(model_uri: str, tracking_uri: str = "", dst: str | None = None) -> ModelFiles:
    """A registered version (``models:/<name>/<version>`` or ``models:/<name>@<alias>``), downloaded
    (into ``dst``, default a new temporary folder)."""
    from pipeline import registry

    try:
        folder = registry.download_version(model_uri, tracking_uri, dst)
    except ValueError as e:
        raise ModelNotFound(str(e)) from None
    art = folder / "artifacts"
    ours = art / registry.OURS
    if not (ours / "model.pt").exists():
        raise ModelNotFound(f"{model_uri}: not a version the register stage made (no artifacts/{registry.OURS}/model.pt)")
    ct2 = {p.name[len("ct2-"):]: str(p) for p in sorted(art.glob("ct2-*")) if p.is_dir()}  # as register wrote them
    text = storage.read_json(str(ours / "text.json")) if (ours / "text.json").exists() else {}  # older versions: none
    import os

    scores = registry.version_scores(model_uri, tracking_uri or os.environ.get("MLFLOW_TRACKING_URI", ""))
    return ModelFiles(model=str(ours / "model.pt"), model_config=storage.read_json(str(ours / "model_config.json")),
                      spm=str(ours / "spm.model"), origin=model_uri, ct2=ct2, text=text,
                      hf=str(art / "hf") if (art / "hf").is_dir() else "",
                      no_ct2="" if ct2 else "the version holds no CTranslate2 model", scores=scores)
