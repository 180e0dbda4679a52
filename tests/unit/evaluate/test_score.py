"""The score stage on small files: metrics, scores.json, report.md, line-count checks."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.decoding import bleu
from pipeline.evaluate import score
from pipeline.config import Config
from pipeline.stage import Manifest, StageContext

REFS = ["Das Open-Source-Projekt läuft sehr gut.", "Die E-Mail ist angekommen.", "Guten Morgen!"]
HYPS = ["Das Open-Source-Projekt läuft gut.", "Die E-Mail kam an.", "Guten Morgen!"]


class RecordingTracker:
    run_id = tracking_uri = None

    def __init__(self):
        self.texts, self.tags = {}, {}

    def log_text(self, text, artifact_file):
        self.texts[artifact_file] = text

    def set_tags(self, tags):
        self.tags.update(tags)

    def log_metrics(self, metrics, step=None):
        pass

    def log_params(self, params):
        pass

    def log_artifact(self, local_path, artifact_path=None):
        pass


def _ctx(tmp_path, splits, hyps_by_split, cfg=None):
    cfg = cfg or Config()
    cfg.score.splits = splits
    cfg.score.attention_sentences = 0  # no model here: the heatmaps are tested in tests/integration/test_multi30k.py
    enc_splits, tr_splits = {}, {}
    for split in splits:
        d = tmp_path / "encode" / split
        d.mkdir(parents=True)
        order = [2, 0, 1]  # stored out of order: score must restore idx order
        pq.write_table(pa.table({"idx": pa.array(order, pa.int64()), "tgt": [REFS[i] for i in order]}),
                       d / "part-0.parquet")
        enc_splits[split] = {"dir": str(d), "num_rows": 3}
        hyp_file = tmp_path / f"hyps.{split}.txt"
        hyp_file.write_text("".join(h + "\n" for h in hyps_by_split), encoding="utf-8")
        tr_splits[split] = {"hyps": str(hyp_file), "num_sentences": 3, "num_truncated": 0, "num_empty": 0}
    translate_out = {"splits": tr_splits, "decode": {"beam_size": 4, "alpha": 0.6, "max_len_a": 1.0, "max_len_b": 50}}
    # Training facts come from train, the averaged checkpoints from average: each from its maker.
    train_out = {"final_step": 1234, "model_config": {"d_model": 512, "d_ff": 2048}, "wall_s": 7200.0,
                 "num_workers": 8, "device": "GPU", "gpu_hours": 16.0}
    average_out = {"averaged": ["a", "b"], "steps": [1000, 1234]}
    out = tmp_path / "score"
    out.mkdir()
    return StageContext(name="score", key="s", cfg=cfg, out_dir=str(out), tracker=RecordingTracker(), inputs={
        "translate": Manifest(stage="translate", key="t", dir="", outputs=translate_out),
        "train": Manifest(stage="train", key="tr", dir="", outputs=train_out),
        "average": Manifest(stage="average", key="a", dir="", outputs=average_out),
        "encode": Manifest(stage="encode", key="e", dir="", outputs={"splits": enc_splits})})


def test_score_stage_writes_metrics_scores_and_report(tmp_path):
    ctx = _ctx(tmp_path, ["test", "dev"], HYPS)
    result = score.run(ctx)
    assert set(result.metrics) == {f"{s}/{m}" for s in ("test", "dev") for m in ("bleu_sacre", "bleu_tok_cs", "chrf")}
    assert result.metrics["test/bleu_sacre"] == pytest.approx(bleu.sacre_bleu(HYPS, REFS).score)
    assert result.metrics["test/bleu_tok_cs"] == pytest.approx(bleu.tokenized_bleu_cs(HYPS, REFS).score)
    assert result.metrics["test/chrf"] == pytest.approx(bleu.chrf(HYPS, REFS).score)
    test = result.outputs["scores"]["test"]
    assert set(test) == {"bleu_sacre", "sacrebleu_signature", "bleu_sacre_reference", "bleu_tok_cs",
                         "bleu_tok_cs_signature", "chrf", "chrf_signature"}
    assert test["bleu_sacre_reference"] == "raw" and test["bleu_tok_cs_signature"].startswith("bleu_tok_cs: sacremoses")
    assert test["sacrebleu_signature"].startswith("nrefs:1|case:mixed|eff:no|tok:13a")

    saved = json.loads((tmp_path / "score" / "scores.json").read_text())
    assert saved["test"]["bleu_tok_cs"] == pytest.approx(test["bleu_tok_cs"])
    report = (tmp_path / "score" / "report.md").read_text()
    assert report.startswith("# Transformer EN-DE: results")
    assert "27.3" in report and "28.4" in report and test["sacrebleu_signature"] in report
    assert "| paper, Transformer base (Table 2) **(this run's row)** | newstest2014 | 27.3 |" in report
    assert "38.1" not in report and "e1bde977" in report
    assert "1234 steps" in report and "beam 4" in report and "(steps [1000, 1234])" in report
    assert "2.00 h of training loop on 8 GPU worker(s), 16.0 GPU-hours" in report
    assert ctx.tracker.texts["report.md"] == report and "scores.json" in ctx.tracker.texts


def test_score_stage_refuses_misaligned_hypotheses(tmp_path):
    with pytest.raises(ValueError, match="2 hypotheses for 3 references"):
        score.run(_ctx(tmp_path, ["test"], HYPS[:2]))


def test_empty_hypothesis_lines_are_kept(tmp_path):
    result = score.run(_ctx(tmp_path, ["test"], ["", HYPS[1], HYPS[2]]))
    assert 0 < result.metrics["test/bleu_sacre"] < 100


def test_en_fr_report_has_its_own_row_and_no_compound_split(tmp_path):
    cfg = Config()
    cfg.data.tgt_lang = "fr"
    cfg.model.d_model, cfg.model.d_ff, cfg.model.n_heads = 1024, 4096, 16  # big
    hyps, refs = ["C'est un vis-à-vis."] * 3, REFS  # any text: the metric choice is what is tested
    result = score.run(_ctx(tmp_path, ["test"], hyps, cfg))
    assert set(result.metrics) == {"test/bleu_sacre", "test/bleu_tok", "test/chrf"}
    assert result.metrics["test/bleu_tok"] == pytest.approx(
        bleu.tokenized_bleu(hyps, refs, "fr", compound_split=False).score)
    report = (tmp_path / "score" / "report.md").read_text()
    assert report.startswith("# Transformer EN-FR: results")
    assert "| paper, Transformer big (Table 2) **(this run's row)** | newstest2014 | 41.8 |" in report
    assert "| paper, Transformer base (Table 2) | newstest2014 | 38.1 |" in report
    assert "27.3" not in report and "(tokenized, compound split)" not in report and "-l fr" in report


def test_custom_data_gets_no_paper_row(tmp_path):
    cfg = Config()
    cfg.data.source, cfg.data.tgt_lang = "custom", "de"
    cfg.data.train_src, cfg.data.train_tgt = ["a.en"], ["a.de"]
    cfg.data.dev_src = cfg.data.dev_tgt = "dev.txt"
    cfg.data.test_src, cfg.data.test_tgt = "mytest.en", "mytest.de"
    score.run(_ctx(tmp_path, ["test"], HYPS, cfg))
    report = (tmp_path / "score" / "report.md").read_text()
    assert "27.3" not in report and "28.4" not in report and "newstest" not in report
    assert "custom test set (mytest.en)" in report and "has no row for EN-DE" in report
