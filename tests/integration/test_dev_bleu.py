"""Dev BLEU per checkpoint while training runs (Ray Train's asynchronous validation), end to end.

The data stages run once (tiny: 1500 pairs per corpus, a 600-piece vocabulary); then a local run of
`train` logs `dev/bleu_sacre` into its MLflow run at checkpoint steps while the loop still trains,
each value equal to what the translate CLI and the sacrebleu CLI give for that checkpoint; a run
whose validation task raises still finishes normally.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.config import load_config
from pipeline.decoding.batching import read_split
from pipeline.stage import MANIFEST, Manifest, StageContext
from workflows import reproduce_base

# The bound on each test (pytest-timeout): a Ray Train run with asynchronous validation.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]
SENTENCES = 60
# All three corpora of the mirror (local.toml reads News Commentary alone), as test_end_to_end.py's TINY.
DATA = ["--config", "configs/local.toml", "--data.corpora=", "--data.max_pairs_per_corpus=1500", "--data.num_shards=2",
        "--vocab.size=600", "--vocab.sample_sentences=6000"]
TRAIN = ["--model.d_model=32", "--model.d_ff=64", "--model.n_heads=2", "--model.n_encoder_layers=1",
         "--model.n_decoder_layers=1", "--model.max_positions=256", "--workers.num_workers=1", "--speed.precision=fp32",
         "--train.max_steps=200", "--train.warmup_steps=100", "--train.tokens_per_step=1500",
         "--speed.max_tokens_per_batch=1500", "--checkpoint.interval_steps=40",
         "--metrics.val_loss_interval_steps=40", "--metrics.log_interval_steps=10", "--checkpoint.num_to_keep=10",
         "--average.checkpoints=2", f"--dev_bleu.sentences={SENTENCES}", "--dev_bleu.resources=CPU=0",
         # Greedy CTranslate2 in float32 decodes exactly as our search does (tests/integration/test_export.py),
         # so the translate CLI (our search) must reproduce every logged number.
         "--dev_bleu.beam_size=1", "--dev_bleu.engine=ctranslate2", "--dev_bleu.quantization=float32"]


def _manifest(work: Path, stage: str) -> Manifest:
    (path,) = (work / stage).glob(f"*/{MANIFEST}")
    return Manifest.from_dict(json.loads(path.read_text()))


@pytest.fixture(scope="module")
def work(tmp_path_factory, mirror_dir, ray_local) -> Path:
    work = tmp_path_factory.mktemp("dev_bleu") / "work"
    assert reproduce_base.main([*DATA, f"--run.work_dir={work}", f"--data.mirror={mirror_dir}", "--to", "encode"]) == 0
    return work


def test_dev_bleu_is_logged_while_training_and_matches_the_translate_cli(work, mirror_dir, tmp_path):
    from mlflow import MlflowClient

    args = [*DATA, *TRAIN, f"--run.work_dir={work}", f"--data.mirror={mirror_dir}"]
    assert reproduce_base.main([*args, "--to", "train"]) == 0

    train = _manifest(work, "train")
    client = MlflowClient(f"sqlite:///{work}/mlflow.db")
    (run,) = client.search_runs(client.get_experiment_by_name("transformer-wmt14-ende").experiment_id,
                                "tags.stage = 'train' and tags.cached = 'false'")
    bleu = {m.step: m for m in client.get_metric_history(run.info.run_id, "dev/bleu_sacre")}
    chrf = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "dev/chrf")}
    last_loss = max(client.get_metric_history(run.info.run_id, "train/loss"), key=lambda m: m.step)
    assert last_loss.step == 200
    dev = train.outputs["dev_bleu"]
    # Validations run beside the loop, one at a time; a task that starts after a newer checkpoint is
    # registered skips to it. How many run while the loop still trains depends on the machine's load
    # (on a busy 2-core CI machine the first task may start only after the last step), so the test
    # asks for what always holds: the last checkpoint scored, every other one scored or skipped for a
    # newer one, and each task that scored a checkpoint before the last started while that checkpoint
    # was the newest registered one (the loop had not yet reported its last), so before the last
    # checkpoint's task. (Not before the last train/loss point: the loop logs it before it writes and
    # registers the last checkpoint, and a task may start in between, as on CI once.)
    records = {r["step"]: r for r in dev["records"]}
    started = {s: r["started_unix"] for s, r in records.items() if r["status"] == "validated"}
    assert 200 in started and set(started) <= {40, 80, 120, 160, 200}, (started, sorted(bleu), last_loss)
    assert all(records[s]["newest_step"] == s and t < started[200] for s, t in started.items() if s < 200), records
    assert all(r["newest_step"] > s for s, r in records.items() if r["status"] == "skipped"), records
    assert set(started) == set(bleu)
    assert dev["num_validated"] == len(bleu) and dev["num_failed"] == 0
    assert dev["num_validated"] + dev["num_skipped"] == 5  # every checkpoint: scored, or skipped for a newer one

    # The reference: the translate CLI on that checkpoint and the same sentences, then the sacrebleu CLI.
    split = read_split(_manifest(work, "encode").outputs["splits"]["dev"]["dir"], ["idx", "src", "tgt"]).iloc[:SENTENCES]
    src, ref = tmp_path / "dev.en", tmp_path / "dev.de"
    src.write_text("".join(f"{s}\n" for s in split["src"]), encoding="utf-8")
    ref.write_text("".join(f"{t}\n" for t in split["tgt"]), encoding="utf-8")
    cfg = load_config([REPO / "configs/local.toml"])
    spm = _manifest(work, "vocab").outputs["model"]
    for step in sorted(bleu)[:2]:
        checkpoint = Path(train.outputs["storage_path"]) / train.key / f"checkpoint_{step:07d}"
        hyps = subprocess.run(
            [sys.executable, "-m", "pipeline.decoding.translate_cli", "--model-dir", str(checkpoint), "--spm", spm,
             "--beam", "1", "--alpha", str(cfg.decode.alpha), "--max-len-a", str(cfg.decode.max_len_a),
             "--max-len-b", str(cfg.decode.max_len_b), "--device", "cpu"],
            input=src.read_text(encoding="utf-8"), capture_output=True, text=True, check=True, cwd=REPO,
            env={**os.environ, "OMP_NUM_THREADS": "1"}).stdout  # one thread, as the dev-BLEU task decodes
        hyp = tmp_path / f"hyp.{step}.de"
        hyp.write_text(hyps, encoding="utf-8")
        want_bleu, want_chrf = (float(subprocess.run(
            [str(Path(sys.executable).parent / "sacrebleu"), str(ref), "-i", str(hyp), "-m", metric, "-b", "-w", "6"],
            capture_output=True, text=True, check=True).stdout) for metric in ("bleu", "chrf"))
        assert bleu[step].value == pytest.approx(want_bleu, abs=1e-4), step
        assert chrf[step] == pytest.approx(want_chrf, abs=1e-4), step


def test_a_failing_validation_task_leaves_the_run_finishing(work, tmp_path):
    from pipeline.train import driver as train_stage

    bad_spm = tmp_path / "spm.model"
    bad_spm.write_bytes(b"not a SentencePiece model")  # training never reads it; the validation task does
    cfg = load_config([REPO / "configs/local.toml"], [a for a in TRAIN if not a.startswith("--train.max_steps")]
                      + [f"--run.work_dir={tmp_path / 'work'}", "--train.max_steps=80", "--tracking.enabled=false"])
    encode, vocab = _manifest(work, "encode"), _manifest(work, "vocab")
    vocab.outputs = {**vocab.outputs, "model": str(bad_spm)}
    ctx = StageContext(name="train", key="failing-validation", cfg=cfg, out_dir=str(tmp_path / "work" / "train" / "k"),
                       inputs={"encode": encode, "vocab": vocab})
    result = train_stage.run(ctx)

    assert result.outputs["final_step"] == 80 and len(result.outputs["checkpoints"]) == 2
    dev = result.outputs["dev_bleu"]
    assert dev["num_validated"] == 0 and dev["num_failed"] >= 1, dev
    failed = [r for r in dev["records"] if r["status"] == "failed"]
    assert all("spm.model" in r["error"] or "SentencePiece" in r["error"] or "ParseFromArray" in r["error"]
               for r in failed), failed
    assert result.metrics["dev/bleu_num_failed"] == dev["num_failed"]
