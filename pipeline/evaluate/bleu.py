"""Scoring functions for detokenized German hypotheses against raw references (pure, no Ray).

Two BLEU numbers, never confused with each other:

- ``sacre_bleu``: sacreBLEU with its default 13a tokenizer on detokenized text. The honest,
  comparable number; its signature string says exactly how it was computed.
- ``tokenized_bleu_cs``: the number the paper reports (27.3 base, 28.4 big, §6.1, Table 2),
  computed the way tensor2tensor's ``utils/get_ende_bleu.sh`` does it:

      tokenizer.perl -l de < hyp > hyp.tok                       # Moses tokenizer, German
      perl -ple 's{(\\S)-(\\S)}{$1 ##AT##-##AT## $2}g'          # "compound splitting"
      multi-bleu.perl ref.tok.atat < hyp.tok.atat

  * Moses tokenization: sacremoses ``MosesTokenizer(lang="de")`` with ``escape=True``.
    tokenizer.perl escapes XML-special characters by default (``&`` -> ``&amp;``, ``"`` ->
    ``&quot;``, ``'`` -> ``&apos;``, ``<``, ``>``, ``[``, ``]``, ``|``; only ``-no-escape`` turns it
    off) and get_ende_bleu.sh does not pass ``-no-escape``. Escaping maps each such
    character to one token on both sides, so it changes no n-gram match; we keep it for
    fidelity. No ``-a`` (aggressive hyphen splitting), no unicode punctuation normalisation
    (the script used for the paper had neither).
  * The reference is tokenized the same way (t2t's ``newstest2014.tok.de`` is the raw
    reference through ``tokenizer.perl -l de``).
  * The ATAT regex is applied to both sides with Perl's non-overlapping left-to-right
    semantics, which Python's ``re.sub`` shares: ``a-b-c`` -> ``a ##AT##-##AT## b-c`` (the
    second hyphen's left neighbour was already consumed). Faithful, quirk included.
  * multi-bleu.perl's arithmetic equals sacreBLEU's on pre-tokenized text with
    ``tokenize="none"`` (whitespace split), ``smooth_method="none"`` (a zero n-gram
    precision gives BLEU 0, as multi-bleu's ``my_log(0) = -9999999999`` does), case-sensitive,
    single reference, brevity penalty ``exp(1 - r/c)`` when ``c < r``. ``force=True`` only
    silences sacreBLEU's "looks tokenized" warning.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Sequence

from sacrebleu.metrics import BLEU, CHRF

# tensor2tensor/utils/get_ende_bleu.sh: perl -ple 's{(\S)-(\S)}{$1 ##AT##-##AT## $2}g'
_ATAT = re.compile(r"(\S)-(\S)")

# The paper's numbers (Table 2, newstest2014 EN-DE, tokenized BLEU with compound splitting).
PAPER_BLEU = {"base": 27.3, "big": 28.4}


@dataclass
class Score:
    score: float
    signature: str  # how it was computed (sacreBLEU signature, or our own description)
    detail: str  # n-gram precisions, brevity penalty, lengths


def _check(hyps: Sequence[str], refs: Sequence[str]) -> None:
    if len(hyps) != len(refs):
        raise ValueError(f"{len(hyps)} hypotheses but {len(refs)} references: they must be line-aligned")


def sacre_bleu(hyps: Sequence[str], refs: Sequence[str]) -> Score:
    """sacreBLEU with its defaults (13a tokenizer, exp smoothing, mixed case): the CLI's number."""
    _check(hyps, refs)
    metric = BLEU()
    result = metric.corpus_score(list(hyps), [list(refs)])
    return Score(result.score, str(metric.get_signature()), str(result))


def chrf(hyps: Sequence[str], refs: Sequence[str]) -> Score:
    """chrF2 (sacreBLEU's ``CHRF`` defaults: char 6-grams, beta 2, no word n-grams)."""
    _check(hyps, refs)
    metric = CHRF()
    result = metric.corpus_score(list(hyps), [list(refs)])
    return Score(result.score, str(metric.get_signature()), str(result))


@functools.lru_cache(maxsize=1)
def _moses_de():
    from sacremoses import MosesTokenizer

    return MosesTokenizer(lang="de")


def moses_tokenize_de(line: str) -> str:
    """``tokenizer.perl -l de`` (escaping on, as in the script): a space-joined token string."""
    return _moses_de().tokenize(line, escape=True, return_str=True)


def atat_split(line: str) -> str:
    """get_ende_bleu.sh's compound split: ``rich-text`` -> ``rich ##AT##-##AT## text``."""
    return _ATAT.sub(r"\1 ##AT##-##AT## \2", line)


def multi_bleu(hyps_tok: Sequence[str], refs_tok: Sequence[str]) -> Score:
    """multi-bleu.perl on already tokenized text (see the module docstring for the equivalence)."""
    _check(hyps_tok, refs_tok)
    metric = BLEU(tokenize="none", smooth_method="none", force=True)
    result = metric.corpus_score(list(hyps_tok), [list(refs_tok)])
    return Score(result.score, "multi-bleu.perl equivalent: " + str(metric.get_signature()), str(result))


def tokenized_bleu_cs(hyps: Sequence[str], refs: Sequence[str]) -> Score:
    """The paper's BLEU: Moses-tokenized (de), ATAT compound split, multi-bleu.perl. NOT sacreBLEU."""
    _check(hyps, refs)
    hyps_t = [atat_split(moses_tokenize_de(h)) for h in hyps]
    refs_t = [atat_split(moses_tokenize_de(r)) for r in refs]
    result = multi_bleu(hyps_t, refs_t)
    sig = ("bleu_tok_cs: sacremoses MosesTokenizer(lang=de, escape=True) + "
           "ATAT s{(\\S)-(\\S)}{$1 ##AT##-##AT## $2}g on hyp and ref + " + result.signature)
    return Score(result.score, sig, result.detail)
