"""The ``register`` stage: an MLflow Model Registry version that MLflow's own tools load and serve.

The tiny trained and exported model (tests/conftest.py, tests/integration/conftest.py) is registered with beam 1 so
that its translations have an independent reference: our greedy search (test_export.py shows the
Marian folder's greedy outputs equal ours). Checked with MLflow itself: the version's tags and run,
``mlflow.pyfunc.load_model("models:/...")``, ``mlflow models serve --env-manager local``, the
local SQLite store and the tracking server the suite starts; a second registration of the same
export output adds no version, a new export output does.
"""

from __future__ import annotations

import json
import os
import urllib.request

import pytest

from tests.support.procs import BIN, free_port, start, stop, wait_http
from tests.support.registered import NAME, register_tiny

# The bound on each test (pytest-timeout): the session's tiny model and its export may be made here first.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

NUM_SENTENCES = 6


@pytest.fixture(scope="module")
def sentences(tiny_model) -> list[str]:
    return tiny_model["test_en"][:NUM_SENTENCES]


@pytest.fixture(scope="module")
def greedy(tiny_model, sentences) -> list[str]:
    """Our greedy search, detokenized as the server does: the reference."""
    from pipeline.decoding.translator import Translator

    tr = Translator(tiny_model["model"], tiny_model["model_config"], tiny_model["spm"], {"beam_size": 1})
    return [tr.translate_ids([tr.sp.encode(s) + [tr.cfg.eos_id]])[0] for s in sentences]


@pytest.fixture(scope="module")
def sqlite_registry(tiny_model, tiny_export, tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("registry")
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    return {"uri": uri, "first": register_tiny(uri, tiny_model, tiny_export, tmp), "tmp": tmp}


def test_a_version_with_its_run_scores_and_config(sqlite_registry):
    from mlflow import MlflowClient

    first, uri = sqlite_registry["first"], sqlite_registry["uri"]
    assert first["created"] and first["model_uri"] == f"models:/{NAME}/1"
    client = MlflowClient(uri, registry_uri=uri)
    v = client.get_model_version(NAME, "1")
    assert v.run_id == first["run_id"]
    assert v.tags["test/bleu_sacre"] == "1.5" and v.tags["test/chrf"] == "20.25"
    assert v.tags["train_key"] == "trainkey" and v.tags["average_key"] == "avgkey"
    assert json.loads(v.tags["config"])["decode"]["beam_size"] == 1 and v.tags["decode.beam_size"] == "1"
    files = {a.path for a in client.list_artifacts(first["run_id"], "model/artifacts")}
    assert {f"model/artifacts/{d}" for d in ("hf", "ours", "ct2-float32", "ct2-int8")} <= files


def test_the_same_export_again_adds_no_version_a_new_one_does(sqlite_registry, tiny_model, tiny_export):
    from mlflow import MlflowClient

    uri, tmp = sqlite_registry["uri"], sqlite_registry["tmp"]
    again = register_tiny(uri, tiny_model, tiny_export, tmp)
    assert (again["version"], again["created"]) == ("1", False)
    forced = register_tiny(uri, tiny_model, tiny_export, tmp, finished="2026-12-01T11:00:00")  # a rerun export
    assert (forced["version"], forced["created"]) == ("2", True)
    versions = MlflowClient(uri, registry_uri=uri).search_model_versions(f"name = '{NAME}'")
    assert sorted(str(v.version) for v in versions) == ["1", "2"]


def test_pyfunc_load_model_translates_like_our_greedy_search(sqlite_registry, sentences, greedy, monkeypatch):
    import mlflow

    # mlflow.set_tracking_uri also exports MLFLOW_TRACKING_URI (and the registry's): without this,
    # the restore below would leave it set for every later test and the drivers they start.
    for var in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI"):
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)
    before = mlflow.get_tracking_uri(), mlflow.get_registry_uri()
    mlflow.set_tracking_uri(sqlite_registry["uri"])
    mlflow.set_registry_uri(sqlite_registry["uri"])
    try:
        model = mlflow.pyfunc.load_model(f"models:/{NAME}/1")
        one_by_one = [model.predict([s])[0] for s in sentences]
        together = model.predict(sentences)
    finally:
        mlflow.set_tracking_uri(before[0])
        mlflow.set_registry_uri(before[1])
    assert one_by_one == greedy
    assert together == greedy  # one batch of all sentences: the same as each alone


def test_mlflow_models_serve_answers(sqlite_registry, sentences, greedy, tmp_path):
    port = free_port()
    env = {"MLFLOW_TRACKING_URI": sqlite_registry["uri"], "MLFLOW_REGISTRY_URI": sqlite_registry["uri"],
           "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}  # it execs `uvicorn`, as in an activated venv
    proc = start([str(BIN / "mlflow"), "models", "serve", "-m", f"models:/{NAME}/1", "--env-manager", "local",
                  "-h", "127.0.0.1", "-p", str(port), "-w", "1"], tmp_path / "models-serve.log", env=env)
    try:
        wait_http(f"http://127.0.0.1:{port}/ping", timeout_s=240, proc=proc)
        req = urllib.request.Request(f"http://127.0.0.1:{port}/invocations", method="POST",
                                     data=json.dumps({"inputs": sentences[:1]}).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            answer = json.loads(r.read())
    finally:
        stop(proc, timeout_s=10)
    assert answer["predictions"] == greedy[:1], (tmp_path / "models-serve.log").read_text()[-3000:]


def test_the_tracking_server_holds_versions_that_serve_can_resolve(mlflow_uri, tiny_model, tiny_export,
                                                                   tmp_path, sentences, greedy):
    from pipeline.decoding.translator import Translator
    from pipeline.models import find_model

    out = register_tiny(mlflow_uri, tiny_model, tiny_export, tmp_path)
    assert out["created"] and out["version"] == "1"
    files = find_model(model_uri=out["model_uri"], tracking_uri=mlflow_uri)
    assert set(files.ct2) == {"float32", "int8"} and os.path.isdir(files.hf)
    tr = Translator(files.model, files.model_config, files.spm, {"beam_size": 1})
    assert [tr.translate_ids([tr.sp.encode(s) + [tr.cfg.eos_id]])[0] for s in sentences] == greedy
