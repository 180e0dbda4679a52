"""Scoring functions for detokenized hypotheses against raw references (pure, no Ray).

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
    ``perl -ple`` (no ``-C``, no ``use utf8``) reads *bytes*: ``\\S`` is one byte and only ASCII
    whitespace is ``\\s``. So the regex runs on the UTF-8 bytes here too: ``vis-à-vis`` splits at
    both hyphens (``à`` is two bytes, so the second hyphen's left neighbour is still free), and a
    no-break space (C2 A0) next to a hyphen counts as a non-space, exactly as in perl.
  * Which script: the get_ende_bleu.sh of the paper's time (tensor2tensor e1bde977, 2017-11-08;
    the same steps since 75f398d8, 2017-06-29): tokenize, ATAT, multi-bleu. The
    ``replace-unicode-punctuation.perl -l de`` step was added later (fc9335c0, 2018-04-05) and
    lowers scores by ~0.5-0.8 BLEU; it is NOT applied here.

English-French (Table 2: 38.1 base, 41.8 big): tensor2tensor published no EN-FR scoring script
(get_ende_bleu.sh is German-only; its ``t2t-bleu`` uses mteval's international tokenization, not
the paper's tokenized BLEU). ``tokenized_bleu(..., lang="fr", compound_split=False)`` is the
usual tokenized BLEU of that era: ``tokenizer.perl -l fr`` + multi-bleu.perl, no ATAT split
(the ATAT convention, from Stanford's NMT and get_ende_bleu.sh, is for German compounds).
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

# tensor2tensor/utils/get_ende_bleu.sh: perl -ple 's{(\S)-(\S)}{$1 ##AT##-##AT## $2}g', on bytes
# as perl reads them (Python's bytes \s is perl's ASCII \s: space, \t, \n, \v, \f, \r).
_ATAT = re.compile(rb"(\S)-(\S)")

# The paper's numbers (Table 2, newstest2014, tokenized BLEU; EN-DE with compound splitting).
PAPER_TABLE2 = {"en-de": {"base": 27.3, "big": 28.4}, "en-fr": {"base": 38.1, "big": 41.8}}


@dataclass
class Score:
    score: float
    signature: str  # how it was computed (sacreBLEU signature, or our own description)
    detail: str  # n-gram precisions, brevity penalty, lengths


def _check(hyps: Sequence[str], refs: Sequence[str]) -> None:
    if len(hyps) != len(refs):
        raise ValueError(f"{len(hyps)} hypotheses but {len(refs)} references: they must be line-aligned")


def sacre_bleu(hyps: Sequence[str], refs: Sequence[str], lowercase: bool = False) -> Score:
    """sacreBLEU with its defaults (13a tokenizer, exp smoothing, mixed case): the CLI's number;
    ``lowercase``: the CLI's ``-lc`` (``case:lc`` in the signature)."""
    _check(hyps, refs)
    metric = BLEU(lowercase=lowercase)
    result = metric.corpus_score(list(hyps), [list(refs)])
    return Score(result.score, str(metric.get_signature()), str(result))


def chrf(hyps: Sequence[str], refs: Sequence[str], lowercase: bool = False) -> Score:
    """chrF2 (sacreBLEU's ``CHRF`` defaults: char 6-grams, beta 2, no word n-grams); ``lowercase``:
    case-insensitive (``-lc``)."""
    _check(hyps, refs)
    metric = CHRF(lowercase=lowercase)
    result = metric.corpus_score(list(hyps), [list(refs)])
    return Score(result.score, str(metric.get_signature()), str(result))


@functools.lru_cache(maxsize=4)
def _moses(lang: str):
    from sacremoses import MosesTokenizer

    return MosesTokenizer(lang=lang)


def moses_tokenize(line: str, lang: str) -> str:
    """``tokenizer.perl -l LANG`` (escaping on, as in the script): a space-joined token string."""
    return _moses(lang).tokenize(line, escape=True, return_str=True)


def moses_tokenize_de(line: str) -> str:
    """``tokenizer.perl -l de``."""
    return moses_tokenize(line, "de")


def atat_split(line: str) -> str:
    """get_ende_bleu.sh's compound split: ``rich-text`` -> ``rich ##AT##-##AT## text``, on UTF-8
    bytes as ``perl -ple`` does. A hyphen is ASCII, so the bytes on either side of each inserted
    `` ##AT##-##AT## `` are character boundaries: the result is valid UTF-8."""
    return _ATAT.sub(rb"\1 ##AT##-##AT## \2", line.encode("utf-8")).decode("utf-8")


def multi_bleu(hyps_tok: Sequence[str], refs_tok: Sequence[str]) -> Score:
    """multi-bleu.perl on already tokenized text (see the module docstring for the equivalence)."""
    _check(hyps_tok, refs_tok)
    metric = BLEU(tokenize="none", smooth_method="none", force=True)
    result = metric.corpus_score(list(hyps_tok), [list(refs_tok)])
    return Score(result.score, "multi-bleu.perl equivalent: " + str(metric.get_signature()), str(result))


def tokenized_bleu(hyps: Sequence[str], refs: Sequence[str], lang: str, compound_split: bool) -> Score:
    """Tokenized BLEU: Moses-tokenized (``lang``), optionally ATAT compound split, multi-bleu.perl."""
    _check(hyps, refs)

    def prep(line: str) -> str:
        tok = moses_tokenize(line, lang)
        return atat_split(tok) if compound_split else tok

    result = multi_bleu([prep(h) for h in hyps], [prep(r) for r in refs])
    name = "bleu_tok_cs" if compound_split else "bleu_tok"
    atat = "ATAT s{(\\S)-(\\S)}{$1 ##AT##-##AT## $2}g on UTF-8 bytes, hyp and ref + " if compound_split else ""
    sig = f"{name}: sacremoses MosesTokenizer(lang={lang}, escape=True) + {atat}{result.signature}"
    return Score(result.score, sig, result.detail)


def tokenized_bleu_cs(hyps: Sequence[str], refs: Sequence[str]) -> Score:
    """The paper's EN-DE BLEU: Moses-tokenized (de), ATAT compound split, multi-bleu.perl. NOT sacreBLEU."""
    return tokenized_bleu(hyps, refs, "de", compound_split=True)


def paper_metric(tgt_lang: str, preprocess: str = "none") -> str:
    """The key of the tokenized BLEU comparable with the published numbers: ``bleu_tok_cs``
    (compound split, get_ende_bleu.sh) for German, ``bleu_tok`` otherwise; ``bleu_tok_lc`` when the
    text was preprocessed as a benchmark defines it (``data.preprocess``, e.g. Multi30k)."""
    if preprocess != "none":
        return "bleu_tok_lc"
    return "bleu_tok_cs" if tgt_lang == "de" else "bleu_tok"


def benchmark_bleu(hyps_tok: Sequence[str], refs_tok: Sequence[str]) -> Score:
    """BLEU4 on text already preprocessed by the benchmark's own recipe (Multi30k: lowercased,
    punctuation-normalized, Moses-tokenized, ``data.preprocess = "lowercase_moses"``), against the
    reference preprocessed the same way: whitespace tokens, no smoothing, one reference. This is the
    number fairseq's ``generate.py --remove-bpe`` prints (``BLEU4 = ...``) and multi-bleu.perl gives."""
    result = multi_bleu(hyps_tok, refs_tok)
    sig = "bleu_tok_lc: the benchmark's own tokenized lowercased text, no further tokenization + " + result.signature
    return Score(result.score, sig, result.detail)


@functools.lru_cache(maxsize=4)
def _detok(lang: str):
    from sacremoses import MosesDetokenizer

    return MosesDetokenizer(lang=lang)


def moses_detokenize(line: str, lang: str) -> str:
    """``detokenizer.perl -l LANG`` (sacremoses; unescapes ``&apos;`` and friends)."""
    return _detok(lang).detokenize(line.split())
