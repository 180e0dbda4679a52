"""The tiny trained model (tests/integration/conftest.py) registered by the real ``register`` stage,
with hand-made upstream manifests and beam 1 (greedy: our greedy search is the reference)."""

from __future__ import annotations

from pipeline.config import Config
from pipeline.stage import Manifest, StageContext

NAME = "transformer-base-en-de"  # Config()'s model section is Table 3 base


def _manifests(tiny_model, tiny_export, finished: str) -> dict[str, Manifest]:
    return {"average": Manifest(stage="average", key="avgkey", dir=tiny_model["model_dir"],
                                outputs={"model": tiny_model["model"], "model_config": tiny_model["model_config"]},
                                extra={"upstream_keys": {"train": "trainkey"}}),
            "vocab": Manifest(stage="vocab", key="vocabkey", dir="", outputs={"model": tiny_model["spm"]}),
            "export": Manifest(stage="export", key="exportkey", dir="",
                               outputs={**tiny_export, "model_config": tiny_model["model_config"]},
                               extra={"finished": finished}),
            "score": Manifest(stage="score", key="scorekey", dir="",
                              outputs={"scores": {"test": {"bleu_sacre": 1.5, "chrf": 20.25}}})}


def register_tiny(uri: str, tiny_model, tiny_export, tmp_path, finished: str = "2026-12-01T10:00:00") -> dict:
    from mlflow import MlflowClient

    from pipeline.serve import register
    from pipeline.tracking import RunLogger

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("register-test")
    exp_id = exp.experiment_id if exp else client.create_experiment(
        "register-test", artifact_location=None if uri.startswith("http") else str(tmp_path / "art"))
    run = client.create_run(exp_id)
    cfg = Config()
    cfg.decode.beam_size = 1  # greedy: comparable with our greedy_search
    ctx = StageContext(name="register", key="k", cfg=cfg, out_dir=str(tmp_path / "register"),
                       inputs=_manifests(tiny_model, tiny_export, finished),
                       tracker=RunLogger(uri, run.info.run_id))
    out = register.run(ctx).outputs
    client.set_terminated(run.info.run_id)
    return {**out, "run_id": run.info.run_id}
