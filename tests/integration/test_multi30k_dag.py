"""configs/multi30k-tiny.toml through the whole DAG in local mode (a few steps of a smaller model):
the Multi30k source from the offline mirror, the benchmark's preprocessing, its BLEU4 beside
cased sacreBLEU, dev BLEU on the preprocessed dev set, and the attention heatmaps in the report
and in MLflow. `make multi30k` is the same code path at full size."""

from __future__ import annotations

import json
import re
import sys

import pytest

from pipeline.dag import ORDER
from workflows import reproduce_base

SMALL = [
    "--model.d_model=32", "--model.d_ff=64", "--model.n_heads=2", "--model.n_encoder_layers=1",
    "--model.n_decoder_layers=1", "--vocab.size=1000", "--speed.precision=fp32",
    "--train.max_steps=24", "--train.warmup_steps=8", "--train.lr_scale=1.0", "--train.tokens_per_step=1500",
    "--speed.max_tokens_per_batch=1500", "--checkpoint.interval_steps=12", "--metrics.val_loss_interval_steps=12",
    "--metrics.log_interval_steps=4", "--checkpoint.num_to_keep=2", "--average.checkpoints=2", "--decode.beam_size=2",
    "--score.max_sentences=100", "--dev_bleu.sentences=100", "--score.attention_sentences=2",
    "--decode.max_len_b=10",
]


@pytest.mark.slow
@pytest.mark.timeout(900)  # ~2-3 min on 2 cores
def test_multi30k_config_end_to_end(tmp_path, multi30k_dir, capsys, monkeypatch):
    from mlflow import MlflowClient

    monkeypatch.chdir(reproduce_base.REPO)
    work = tmp_path / "work"
    rc = reproduce_base.main(["--config", "configs/multi30k-tiny.toml", f"--run.work_dir={work}",
                              f"--data.mirror={multi30k_dir}", *SMALL, f"--record={tmp_path / 'last-run.json'}"])
    out = capsys.readouterr().out
    assert rc == 0, out

    client = MlflowClient(f"sqlite:///{work}/mlflow.db")
    exp = client.get_experiment_by_name("transformer-multi30k-ende")
    (parent,) = client.search_runs([exp.experiment_id], "attributes.run_name = 'transformer-multi30k-tiny'")
    for key in ("test/bleu_tok_lc", "test/bleu_sacre", "test/chrf", "dev/bleu_tok_lc"):
        assert key in parent.data.metrics, key
    assert "test/bleu_tok_cs" not in parent.data.metrics
    children = {c.data.tags["stage"]: c for c in
                client.search_runs([exp.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")}
    assert sorted(children) == sorted(ORDER)
    # every training pair kept (the recipe filters nothing), the test set's 1000 lines
    prepare = json.loads(next(work.glob("prepare/*/_manifest.json")).read_text())
    assert prepare["outputs"]["splits"]["train"]["num_rows"] == 29000
    assert prepare["outputs"]["splits"]["test"]["num_rows"] == 1000
    # dev BLEU per checkpoint on the preprocessed dev set, the benchmark's metric included
    history = client.get_metric_history(children["train"].info.run_id, "dev/bleu_tok_lc")
    # The last checkpoint is always validated; step 12's is skipped when step 24 is registered first
    # (a backlog drains to the newest, README "Dev BLEU per checkpoint"), as CPU=0 may make it.
    steps = sorted(m.step for m in history)
    assert steps[-1] == 24 and set(steps) <= {12, 24}, steps

    score_dir = next(work.glob("score/*/"))
    report = (score_dir / "report.md").read_text()
    assert "Wu et al. 2021" in report and "BLEU4 (benchmark's lowercased tokenized text)" in report
    assert "Partial test set" in report  # score.max_sentences says so
    scores = json.loads((score_dir / "scores.json").read_text())
    assert scores["test"]["bleu_sacre_reference"] == "raw"
    assert scores["dev"]["bleu_sacre_reference"] == "lowercase_moses, detokenized"
    pngs = sorted(p.name for p in (score_dir / "attention").glob("*.png"))
    assert pngs == ["attention-1-cross.png", "attention-1-encoder.png", "attention-2-cross.png",
                    "attention-2-encoder.png"]
    for name in pngs:
        assert f"(attention/{name})" in report
        assert (score_dir / "attention" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # each sentence's cross-attention heads named in the report: 1 decoder layer x 2 heads (SMALL)
    head_lines = re.findall(r"^   - layer (\d+): head 1: (.+); head 2: (.+)$", report, flags=re.M)
    assert [line[0] for line in head_lines] == ["1", "1"], report
    character = re.compile(r"(mostly attends to .+: \d+%|follows the source in order: .+|spreads its weight: .+)$")
    assert all(character.match(label) for line in head_lines for label in line[1:]), head_lines
    logged = {a.path for a in client.list_artifacts(children["score"].info.run_id, "attention")}
    assert logged == {f"attention/{n}" for n in pngs}

    # The model as a user gets it (translate CLI, server, registered pyfunc): raw sentences in,
    # preprocessed as the training text was (sacremoses, as task1-tokenize.sh), output detokenized.
    import mlflow
    from sacremoses import MosesDetokenizer, MosesPunctNormalizer, MosesTokenizer

    from pipeline.decoding.translator import Translator, translate_lines
    from pipeline.models import find_model

    def task1_tokenize(line: str, lang: str) -> str:
        return MosesTokenizer(lang=lang).tokenize(MosesPunctNormalizer(lang=lang).normalize(line.lower()),
                                                  escape=True, return_str=True)

    raw = ["Two Dogs are playing in the SNOW.", "A man's hat is \"red\"."]
    files = find_model(config=["configs/multi30k-tiny.toml"],
                       overrides=[f"--run.work_dir={work}", f"--data.mirror={multi30k_dir}", *SMALL])
    assert files.text == {"preprocess": "lowercase_moses", "src_lang": "en", "tgt_lang": "de"}
    recorded = find_model(run_record=str(tmp_path / "last-run.json"))  # make serve's lookup: no override repeated
    assert (recorded.model, recorded.spm, recorded.text, recorded.scores) == (files.model, files.spm, files.text,
                                                                              files.scores)
    tr = Translator(files.model, files.model_config, files.spm, {"beam_size": 2, "max_len_b": 10}, text=files.text)
    hyps, _ = translate_lines(tr, raw, 4000)
    direct = tr.translate_ids([tr.sp.encode(task1_tokenize(r, "en")) + [tr.cfg.eos_id] for r in raw])
    assert hyps == [MosesDetokenizer(lang="de").detokenize(h.split()) for h in direct]

    register = json.loads(next(work.glob("register/*/_manifest.json")).read_text())["outputs"]
    # Downloaded with an explicit tracking URI, then loaded from the folder: mlflow.set_tracking_uri
    # would also export MLFLOW_TRACKING_URI to every later test and the drivers they start.
    from pipeline import registry

    folder = registry.download_version(register["model_uri"], f"sqlite:///{work}/mlflow.db", str(tmp_path / "version"))
    pyfunc = mlflow.pyfunc.load_model(str(folder))
    got = pyfunc.predict(raw)
    inner = pyfunc.unwrap_python_model()
    assert inner.text == files.text
    inner.moses = None  # the same model on the tokenized text, detokenized by hand
    plain = pyfunc.predict([task1_tokenize(r, "en") for r in raw])
    assert got == [MosesDetokenizer(lang="de").detokenize(h.split()) for h in plain]

    # The GPU check's Multi30k section (benchmarks/gpu_multi30k.py) on this run's encode output: the
    # same recipe, trained in-process without Ray, averaged, decoded and scored as the DAG did; its
    # BLEU4 is the score stage's (same batches, seed and fp32 arithmetic; thread counts may differ).
    sys.path.insert(0, str(reproduce_base.REPO / "benchmarks"))
    import gpu_multi30k

    bundle = gpu_multi30k.make_bundle("configs/multi30k-tiny.toml", [f"--run.work_dir={work}",
                                      f"--data.mirror={multi30k_dir}", *SMALL], tmp_path / "bundle")
    got = gpu_multi30k.run(bundle, "cpu", tmp_path / "gpu-work")
    assert got["steps"] == 24 and got["averaged"] == ["checkpoint_0000012", "checkpoint_0000024"]
    assert got["sentences"] == 100 and got["beam_size"] == 2
    assert abs(got["bleu4"] - scores["test"]["bleu_tok_lc"]) < 0.5, (got["bleu4"], scores["test"]["bleu_tok_lc"])
