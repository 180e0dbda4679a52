"""The whole DAG in local mode on the offline WMT14 mirror: eight stages, MLflow, cache, reruns.

A tiny model and a 200-sentence slice of newstest2014 keep it to a few minutes on 2 CPUs; the
full local mode (`make run`) is the same code path with bigger numbers.
"""

from __future__ import annotations

import pytest

from pipeline.dag import ORDER
from workflows import reproduce_base

TINY = [
    # all three corpora of the offline mirror (local.toml reads News Commentary alone): its europarl
    # and commoncrawl samples exercise their archives' layouts and messier text
    "--data.corpora=", "--data.max_pairs_per_corpus=1500", "--data.num_shards=2",
    "--vocab.size=600", "--vocab.sample_sentences=6000",
    "--model.d_model=32", "--model.d_ff=64", "--model.n_heads=2",
    "--model.n_encoder_layers=1", "--model.n_decoder_layers=1", "--model.max_positions=256",
    "--workers.num_workers=1", "--workers.use_gpu=false", "--speed.precision=fp32",
    "--train.max_steps=24", "--train.warmup_steps=8", "--train.tokens_per_step=1500",
    "--speed.max_tokens_per_batch=1500", "--checkpoint.interval_steps=8",
    "--metrics.val_loss_interval_steps=12", "--metrics.log_interval_steps=4", "--checkpoint.num_to_keep=2",
    "--average.checkpoints=2", "--decode.beam_size=2", "--decode.num_workers=1", "--decode.use_gpu=false",
    "--score.max_sentences=200", "--decode.max_len_b=20",
]


def run(args: list[str], capsys) -> tuple[int, str]:
    rc = reproduce_base.main(["--config", "configs/local.toml", *args])
    out = capsys.readouterr().out
    return rc, out


def plan_actions(out: str) -> dict[str, str]:
    rows = [line.split() for line in out.splitlines() if line.split() and line.split()[0] in ORDER]
    return {r[0]: r[2] for r in rows}


@pytest.mark.slow
@pytest.mark.timeout(900)  # the whole DAG in local mode (~2-3 min on 2 cores)
def test_local_mode_end_to_end(tmp_path, mirror_dir, capsys, monkeypatch):
    from mlflow import MlflowClient

    monkeypatch.chdir(reproduce_base.REPO)
    args = [f"--run.work_dir={tmp_path / 'work'}", f"--data.mirror={mirror_dir}", *TINY]
    rc, out = run(args, capsys)
    assert rc == 0, out
    assert set(plan_actions(out).values()) == {"run"}

    client = MlflowClient(f"sqlite:///{tmp_path / 'work'}/mlflow.db")
    exp = client.get_experiment_by_name("transformer-wmt14-ende")
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"  # the UI's model-training kind
    (parent,) = client.search_runs([exp.experiment_id], "attributes.run_name = 'transformer-local'")
    for key in ("test/bleu_sacre", "test/bleu_tok_cs", "test/chrf"):
        assert key in parent.data.metrics, key
    assert 0.0 <= parent.data.metrics["test/bleu_sacre"] <= 100.0
    children = client.search_runs([exp.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert sorted(c.data.tags["stage"] for c in children) == sorted(ORDER)
    score_run = next(c for c in children if c.data.tags["stage"] == "score")
    assert {a.path for a in client.list_artifacts(score_run.info.run_id)} >= {"manifest.json"}

    rc, out = run(args, capsys)  # all cached, nothing changes
    assert rc == 0 and set(plan_actions(out).values()) == {"cached"}, out

    rc, out = run([*args, "--force", "translate"], capsys)
    assert rc == 0
    actions = plan_actions(out)
    assert {s for s, a in actions.items() if a == "run"} == {"translate", "score", "register"}, out
    # The registry: one version for the one export output, the rerun's scores on it (register reran)
    store = f"sqlite:///{tmp_path / 'work'}/mlflow.db"
    registry = MlflowClient(store, registry_uri=store)
    (version,) = registry.search_model_versions("name = 'transformer-custom-en-de'")
    assert float(version.tags["test/bleu_sacre"]) == pytest.approx(parent.data.metrics["test/bleu_sacre"])
