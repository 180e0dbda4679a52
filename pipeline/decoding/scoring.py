"""What a score is and what it is set beside: ``score_split`` (BLEU, chrF and the paper's tokenized
BLEU of one split, with their signatures; ``bleu.py`` holds the metrics) and ``setup_of`` (the
language pair, the set names and the published rows a run's scores go beside, and the run's
size: base, big or tiny by its dimensions). Both ``score``'s report and dev BLEU score with
``score_split``; ``score`` and ``register`` (the registered model's name) read ``setup_of``.
"""

from __future__ import annotations

from typing import Any

from model import size_name
from pipeline.config import Config
from pipeline.decoding import bleu

# Published rows on data other than WMT14, by (source, pair, preprocess): (label, size, test set, BLEU).
# Multi30k: LividWo/Revisit-MMT README-baseline.md + evaluate.sh (fairseq generate.py, beam 5, the last
# 10 epoch checkpoints averaged): "BLEU4 = 41.02, 71.0/47.5/34.3/24.5 (BP=0.999 ...)" on test_2016_flickr.
PUBLISHED = {("multi30k", "en-de", "lowercase_moses"): [
    ("Wu et al. 2021, fairseq transformer_tiny (4+4 layers, d_model 128, d_ff 256, 4 heads), beam 5, "
     "last 10 averaged", "tiny", "test_2016_flickr", 41.02)]}


def score_split(hyps: list[str], refs: list[str], tgt_lang: str = "de", preprocess: str = "none",
                raw_refs: list[str] | None = None) -> dict[str, Any]:
    """All three metrics with their signatures and details (pure). The tokenized BLEU is keyed
    ``bleu_tok_cs`` (German, compound split) or ``bleu_tok`` (other targets).

    With a benchmark's preprocessing (``preprocess`` != "none": hypotheses and ``refs`` are the
    benchmark's lowercased tokenized text) it is ``bleu_tok_lc``, the benchmark's own BLEU on that
    text, and sacreBLEU/chrF score the Moses-detokenized hypotheses against ``raw_refs`` (the raw,
    cased reference; without them, against the detokenized ``refs``: ``bleu_sacre_reference`` says
    which), case-insensitively (sacreBLEU's ``-lc``, ``case:lc`` in the signature): a model that
    only ever saw lowercased text cannot be scored on capitals it was never shown."""
    key = bleu.paper_metric(tgt_lang, preprocess)
    if preprocess == "none":
        sacre_hyps, sacre_refs, against = hyps, refs, "raw"
        tok = bleu.tokenized_bleu(hyps, refs, tgt_lang, compound_split=key == "bleu_tok_cs")
    else:
        tok = bleu.benchmark_bleu(hyps, refs)
        sacre_hyps = [bleu.moses_detokenize(h, tgt_lang) for h in hyps]
        if raw_refs is not None:
            sacre_refs, against = list(raw_refs), "raw"
        else:
            sacre_refs, against = [bleu.moses_detokenize(r, tgt_lang) for r in refs], f"{preprocess}, detokenized"
    lc = preprocess != "none"
    sacre, cf = bleu.sacre_bleu(sacre_hyps, sacre_refs, lc), bleu.chrf(sacre_hyps, sacre_refs, lc)
    return {"bleu_sacre": sacre.score, "sacrebleu_signature": sacre.signature, "bleu_sacre_detail": sacre.detail,
            "bleu_sacre_reference": against,
            key: tok.score, f"{key}_signature": tok.signature, f"{key}_detail": tok.detail,
            "chrf": cf.score, "chrf_signature": cf.signature, "num_sentences": len(hyps)}


def setup_of(cfg: Config) -> dict[str, Any]:
    """What the report says the run is: language pair, test/dev set names, the published rows
    (Table 2 for WMT14; the anchor for a benchmark such as Multi30k) as (label, size, set, value)."""
    d, m = cfg.data, cfg.model
    pair = f"{d.src_lang}-{d.tgt_lang}"
    size = size_name(m)  # Table 2's rows (base, big) and the Multi30k anchor's tiny: model.SIZES
    sets = {"wmt14": {"test": "newstest2014 (full)", "dev": "newstest2013"},
            "multi30k": {"test": "Multi30k test_2016_flickr", "dev": "Multi30k val"}}.get(
        d.source, {"test": f"custom test set ({d.test_src})", "dev": f"custom dev set ({d.dev_src})"})
    if d.source == "wmt14":  # Table 2 reports EN->DE and EN->FR only; other directions get no row.
        paper = [(f"paper, Transformer {name} (Table 2)", name, "newstest2014", value)
                 for name, value in bleu.PAPER_TABLE2.get(pair, {}).items()]
    else:
        paper = PUBLISHED.get((d.source, pair, d.preprocess), [])
    return {"pair": d.pair, "tgt_lang": d.tgt_lang, "metric": bleu.paper_metric(d.tgt_lang, d.preprocess),
            "preprocess": d.preprocess, "sets": sets, "paper": paper, "size": size}
