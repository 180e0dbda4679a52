"""The MLflow Model Registry: tracking's second module (with the ``pipeline/tracking/`` package the only
code that talks to MLflow), kept apart because pipeline/tracking/ is about runs.

``register_version`` adds a version of a registered model (one per language pair and size, e.g.
``transformer-base-en-de``) from a local MLflow model folder, logged as the ``model`` artifact of
the register stage's run (the version's source run). A version is identified by its ``identity``
tags (the stage keys and the export output's finish time): registering the same export output
again updates that version's tags and adds none. ``download_version`` fetches a version's files
for ``pipeline/models.py``. Every call names its tracking URI (the local SQLite store or a
server); nothing here reads or sets MLflow's global state.
"""

from __future__ import annotations

import logging
import re
import tempfile
from pathlib import Path
from typing import Any, Callable

log = logging.getLogger(__name__)

OURS = "ours"  # the artifact folder with our model.pt, model_config.json and spm.model
_MAX_TAG_LEN = 5000  # MLflow limits a model version tag's value to 5000 characters
_URI = re.compile(r"^models:/(?P<name>[^/@]+)(?:/(?P<version>\d+)|@(?P<alias>[\w-]+))$")


def _client(tracking_uri: str):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)


def _ensure_registered_model(client: Any, name: str, description: str) -> None:
    from mlflow.exceptions import MlflowException

    try:
        client.create_registered_model(name, description=description)
        log.info("registry: created registered model %s", name)
    except MlflowException as e:
        if e.error_code != "RESOURCE_ALREADY_EXISTS":
            raise


def find_version(tracking_uri: str, name: str, identity: dict[str, str]) -> Any | None:
    """The version of ``name`` whose tags include ``identity``, if any."""
    client = _client(tracking_uri)
    for v in client.search_model_versions(f"name = '{name}'"):
        if all(v.tags.get(k) == val for k, val in identity.items()):
            return v
    return None


def register_version(tracking_uri: str, run_id: str, name: str, model_folder: Callable[[], Path],
                     identity: dict[str, str], tags: dict[str, str], description: str = "") -> tuple[str, bool]:
    """(version, created): the existing version with these ``identity`` tags (its other tags
    updated), or a new one whose files, the folder ``model_folder()`` builds (called only then),
    are logged to ``run_id`` as ``model``."""
    client = _client(tracking_uri)
    _ensure_registered_model(client, name, description)
    tags = {k: str(v)[:_MAX_TAG_LEN] for k, v in {**tags, **identity}.items()}
    existing = find_version(tracking_uri, name, identity)
    if existing is not None:
        for k, v in tags.items():
            client.set_model_version_tag(name, existing.version, k, v)
        log.info("registry: %s version %s already holds this model; tags updated", name, existing.version)
        return str(existing.version), False
    client.log_artifacts(run_id, str(model_folder()), "model")
    source = f"{client.get_run(run_id).info.artifact_uri.rstrip('/')}/model"
    mv = client.create_model_version(name, source, run_id=run_id, tags=tags, description=description)
    log.info("registry: registered %s version %s (run %s)", name, mv.version, run_id)
    return str(mv.version), True


def resolve_uri(model_uri: str, tracking_uri: str) -> Any:
    """The ModelVersion behind ``models:/<name>/<version>`` or ``models:/<name>@<alias>``."""
    m = _URI.match(model_uri)
    if m is None:
        raise ValueError(f"model={model_uri!r}: expected models:/<name>/<version> or models:/<name>@<alias>")
    client = _client(tracking_uri)
    if m["alias"]:
        return client.get_model_version_by_alias(m["name"], m["alias"])
    return client.get_model_version(m["name"], m["version"])


def version_scores(model_uri: str, tracking_uri: str) -> dict[str, dict[str, float]]:
    """The test/dev scores the register stage wrote as the version's tags (``test/bleu_sacre``,
    ...): {split: {metric: value}}, numbers only ({} for a version without them)."""
    scores: dict[str, dict[str, float]] = {}
    for key, value in resolve_uri(model_uri, tracking_uri).tags.items():
        split, _, metric = key.partition("/")
        if split in ("test", "dev") and metric:
            try:
                scores.setdefault(split, {})[metric] = float(value)
            except ValueError:
                pass  # signatures and details: text
    return scores


def download_version(model_uri: str, tracking_uri: str = "", dst: str | None = None) -> Path:
    """A local folder with the version's files (its MLmodel, code and ``artifacts/``)."""
    import os

    import mlflow
    from mlflow.exceptions import MlflowException

    tracking_uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI", "")
    if not tracking_uri:
        raise ValueError(f"model={model_uri}: which MLflow? give tracking_uri=... or set MLFLOW_TRACKING_URI")
    try:
        mv = resolve_uri(model_uri, tracking_uri)
    except MlflowException as e:
        raise ValueError(f"model={model_uri}: not in the registry at {tracking_uri} ({e.message})") from None
    dst = dst or tempfile.mkdtemp(prefix="registered-model-")
    path = mlflow.artifacts.download_artifacts(artifact_uri=mv.source, dst_path=dst, tracking_uri=tracking_uri)
    log.info("registry: %s is %s version %s, downloaded to %s", model_uri, mv.name, mv.version, path)
    return Path(path)
