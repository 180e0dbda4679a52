"""The Multi30k benchmark's BLEU4 (on its own lowercased, tokenized text) and how score reports it
beside cased sacreBLEU on the raw reference."""

from __future__ import annotations

import math

import pytest
from sacrebleu.metrics import BLEU, CHRF

from pipeline.config import Config
from pipeline.decoding import bleu
from pipeline.decoding.scoring import score_split, setup_of
from pipeline.evaluate.score import render_report


def test_hand_counted_case():
    # hyp "the cat sat on the mat" vs ref "the cat sat on a mat": clipped matches 5/6 unigrams,
    # 3/5 bigrams, 2/4 trigrams, 1/3 4-grams; c = r = 6, so BP = 1.
    s = bleu.benchmark_bleu(["the cat sat on the mat"], ["the cat sat on a mat"])
    assert s.score == pytest.approx(100 * (5 / 6 * 3 / 5 * 2 / 4 * 1 / 3) ** 0.25, abs=1e-9)
    short = bleu.benchmark_bleu(["the cat sat on"], ["the cat sat on a mat"])  # BP = exp(1 - 6/4)
    assert short.score == pytest.approx(100 * math.exp(1 - 6 / 4), abs=1e-9)


def test_equals_sacrebleu_on_pretokenized_text():
    hyps = ["ein mann mit einem hut , der etwas anstarrt .", "zwei hunde spielen im &quot; schnee &quot; .",
            "eine frau liest ."]
    refs = ["ein mann mit einem orangefarbenen hut , der etwas anstarrt .", "zwei hunde spielen im schnee .",
            "eine frau liest ein buch ."]
    ref = BLEU(tokenize="none", smooth_method="none").corpus_score(hyps, [refs])
    ours = bleu.benchmark_bleu(hyps, refs)
    assert ours.score == pytest.approx(ref.score, abs=1e-12)
    assert "no further tokenization" in ours.signature and "tok:none" in ours.signature


def test_score_split_with_preprocessing_reports_both_numbers():
    hyps = ["ein mann mit einem hut .", "zwei hunde spielen &quot; fangen &quot; ."]
    refs = ["ein mann mit einem hut .", "zwei hunde spielen ."]
    raw = ["Ein Mann mit einem Hut.", "Zwei Hunde spielen."]
    s = score_split(hyps, refs, "de", "lowercase_moses", raw)
    assert s["bleu_tok_lc"] == pytest.approx(bleu.benchmark_bleu(hyps, refs).score)
    detok = ["ein mann mit einem hut.", 'zwei hunde spielen "fangen".']
    # Case-insensitive (sacreBLEU's -lc): the lowercasing model is not charged for capitals it never saw.
    assert s["bleu_sacre"] == pytest.approx(BLEU(lowercase=True).corpus_score(detok, [raw]).score)
    assert s["bleu_sacre"] > BLEU().corpus_score(detok, [raw]).score + 10  # cased, as before: capitals lost
    assert "|case:lc|" in s["sacrebleu_signature"] and "|case:lc|" in s["chrf_signature"]
    assert s["chrf"] == pytest.approx(CHRF(lowercase=True).corpus_score(detok, [raw]).score)
    assert s["bleu_sacre_reference"] == "raw"
    dev = score_split(hyps, refs, "de", "lowercase_moses")  # no raw reference: the detokenized one
    assert dev["bleu_sacre_reference"] == "lowercase_moses, detokenized" and "|case:lc|" in dev["sacrebleu_signature"]
    assert dev["bleu_sacre"] == pytest.approx(BLEU(lowercase=True).corpus_score(
        detok, [["ein mann mit einem hut.", "zwei hunde spielen."]]).score)
    cased = score_split(["Ein Mann."], ["Ein Mann."], "de")  # raw text, as the paper: case matters
    assert "|case:mixed|" in cased["sacrebleu_signature"] and "|case:mixed|" in cased["chrf_signature"]
    assert "bleu_tok_cs" not in s and "bleu_tok_cs" in score_split(hyps, refs, "de")


def _multi30k_cfg(**model) -> Config:
    cfg = Config()
    cfg.data.source, cfg.data.preprocess = "multi30k", "lowercase_moses"
    for k, v in model.items():
        setattr(cfg.model, k, v)
    return cfg


def test_report_sets_the_published_row_beside_ours():
    cfg = _multi30k_cfg(d_model=128, d_ff=256, n_heads=4, n_encoder_layers=4, n_decoder_layers=4)
    setup = setup_of(cfg)
    assert setup["metric"] == "bleu_tok_lc" and setup["size"] == "tiny"
    assert setup["sets"]["test"] == "Multi30k test_2016_flickr"
    assert [row[-1] for row in setup["paper"]] == [41.02]
    s = score_split(["a b c d e"], ["a b c d e"], "de", "lowercase_moses", ["A b c d e."])
    facts = {"train": {"final_step": 10, "model_config": {}}, "average": {"averaged": []}, "translate": {}}
    report = render_report({"test": s}, facts, setup)
    assert "Wu et al. 2021" in report and "41.02" in report and "**(this run's row)**" in report
    assert "BLEU4 (benchmark's lowercased tokenized text)" in report and "scripts/task1-tokenize.sh" in report
    other = setup_of(_multi30k_cfg(d_model=256))
    assert other["size"] is None and "this run's row" not in render_report({"test": s}, facts, other)
    cfg.data.preprocess = "none"  # cased raw text: no published row to compare with
    assert setup_of(cfg)["paper"] == [] and setup_of(cfg)["metric"] == "bleu_tok_cs"
