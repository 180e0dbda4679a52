"""The registered pyfunc's signature and input example, on a random-weight Marian folder (seconds).

``build_pyfunc`` (the ``register`` stage's model folder) saved and logged as a version of a temporary
SQLite registry, as the stage does it: the version carries an input example of English sentences and
the signature MLflow infers from ``MarianTranslation.predict``'s type hints (a list of strings in and
out), MLflow warns about neither while saving, and the reloaded version translates its own example,
as a Python call and as the scoring server's request. The trained-model checks (translations equal
to our greedy search, ``mlflow models serve``) are in tests/integration/test_register.py.
"""

from __future__ import annotations

import json
import logging
import warnings
from dataclasses import asdict

import pytest

WORDS = "the a dog cat runs sleeps on red green grass mat der die das hund katze läuft schläft auf gras".split()


def _tiny_files(root) -> tuple[dict[str, str], dict]:
    """A random 1+1-layer model, its SentencePiece model and its exported Marian folder."""
    import sentencepiece as spm
    import torch

    from model import ModelConfig, Transformer
    from pipeline.decoding.conversion import export_hf

    lines = [" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(6)) for i in range(200)]
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_prefix=str(root / "spm"), vocab_size=45,
                                   model_type="bpe", pad_id=0, unk_id=1, bos_id=2, eos_id=3, minloglevel=2)
    cfg = ModelConfig(vocab_size=45, d_model=16, d_ff=24, n_heads=2, n_encoder_layers=1, n_decoder_layers=1,
                      max_positions=32, dropout=0.0)
    torch.manual_seed(0)
    state = Transformer(cfg).state_dict()
    torch.save(state, root / "model.pt")
    export_hf(state, cfg, str(root / "spm.model"), root / "hf")
    files = {"model": str(root / "model.pt"), "spm": str(root / "spm.model"), "hf": str(root / "hf")}
    return files, asdict(cfg)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture(scope="module")
def version(tmp_path_factory) -> dict:
    """The tiny model registered in a SQLite store, with what was warned while saving and logging it
    (MLflow translates the example then; the ``mlflow`` and ``transformers`` loggers do not propagate
    to the root logger, hence a handler of their own)."""
    from mlflow import MlflowClient

    from pipeline import registry
    from pipeline.config import Config, DecodeSettings
    from pipeline.serve.register import build_pyfunc

    root = tmp_path_factory.mktemp("pyfunc")
    files, model_config = _tiny_files(root)
    uri = f"sqlite:///{root / 'mlflow.db'}"
    client = MlflowClient(uri)
    run = client.create_run(client.create_experiment("signature", artifact_location=str(root / "art")))
    decode = asdict(DecodeSettings.of(Config().decode))
    handler, loggers = _Records(), [logging.getLogger(name) for name in ("mlflow", "transformers")]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            number, _ = registry.register_version(
                uri, run.info.run_id, "tiny", lambda: build_pyfunc(root / "build", files, model_config, decode),
                {"export_key": "e"}, {})
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
    folder = registry.download_version(f"models:/tiny/{number}", uri, str(root / "version"))
    return {"folder": folder, "warnings": caught, "logged": handler.records}


def test_the_version_has_an_input_example_and_the_type_hints_signature(version):
    from mlflow.models import Model

    from pipeline.serve.register import INPUT_EXAMPLE

    mlmodel = Model.load(str(version["folder"]))
    assert mlmodel.saved_input_example_info is not None
    assert mlmodel.load_input_example(str(version["folder"])) == INPUT_EXAMPLE
    assert mlmodel.signature is not None
    assert mlmodel.signature.inputs.to_dict() == [{"type": "string", "required": True}]
    assert mlmodel.signature.outputs.to_dict() == [{"type": "string", "required": True}]
    assert mlmodel._is_signature_from_type_hint()


def test_saving_it_warns_about_neither_example_nor_type_hints(version):
    logged = [r.getMessage() for r in version["logged"]]
    warned = [str(w.message) for w in version["warnings"]]
    assert not [m for m in logged if "mlflow" in m.lower() or "signature" in m or "example" in m], logged
    assert not [m for m in warned if "input example" in m or "type hint" in m or "signature" in m], warned
    assert not [w for w in version["warnings"] if issubclass(w.category, UserWarning)], warned  # shown by default
    assert not logged, logged  # nothing else either (e.g. generate() on the example: max_length and max_new_tokens)


def test_the_reloaded_version_translates_its_example(version, tmp_path):
    import mlflow

    model = mlflow.pyfunc.load_model(str(version["folder"]))
    example = model.input_example
    out = model.predict(example)
    assert isinstance(out, list) and len(out) == len(example) and all(isinstance(t, str) and t for t in out)
    serving = version["folder"] / "serving_input_example.json"
    assert json.loads(serving.read_text()) == {"inputs": example}  # the body `mlflow models serve` takes
    # The scoring server's parsing and prediction, in this process.
    mlflow.models.predict(str(version["folder"]), input_path=str(serving), content_type="json",
                          output_path=str(tmp_path / "out.json"), env_manager="local")
    assert json.loads((tmp_path / "out.json").read_text()) == {"predictions": out}
    with pytest.raises(mlflow.exceptions.MlflowException, match="type hint"):
        model.predict([1, 2])  # not sentences: rejected by the type hints' check
