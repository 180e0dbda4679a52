"""BLEU and chrF against independent references: the sacrebleu command line, perl, and hand counts."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.decoding import bleu

# Fixed German pairs: punctuation, quotes, a compound with hyphens, a near miss, an exact hit.
HYPS = [
    "Das Open-Source-Projekt läuft gut.",
    "Die E-Mail kam an.",
    'Er sagte: "Wir kommen morgen."',
    "Die Regierung hat die Steuern erhöht.",
    "Am Montag regnet es in Berlin.",
]
REFS = [
    "Das Open-Source-Projekt läuft sehr gut.",
    "Die E-Mail ist angekommen.",
    'Er sagte: "Wir kommen morgen wieder."',
    "Die Regierung hat die Steuern erhöht.",
    "Am Montag wird es in Berlin regnen.",
]


def _sacrebleu_cli(tmp_path: Path, metric: str) -> dict:
    (tmp_path / "hyp.txt").write_text("\n".join(HYPS) + "\n", encoding="utf-8")
    (tmp_path / "ref.txt").write_text("\n".join(REFS) + "\n", encoding="utf-8")
    exe = Path(sys.executable).with_name("sacrebleu")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "sacrebleu"]
    out = subprocess.run(cmd + [str(tmp_path / "ref.txt"), "-i", str(tmp_path / "hyp.txt"), "-m", metric,
                                "-w", "6", "-f", "json"], check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def test_sacre_bleu_equals_the_sacrebleu_command_line(tmp_path):
    cli = _sacrebleu_cli(tmp_path, "bleu")
    ours = bleu.sacre_bleu(HYPS, REFS)
    assert ours.score == pytest.approx(float(cli["score"]), abs=1e-6)
    assert ours.signature == cli["signature"]
    assert "tok:13a" in ours.signature and "smooth:exp" in ours.signature


def test_chrf_equals_the_sacrebleu_command_line(tmp_path):
    cli = _sacrebleu_cli(tmp_path, "chrf")
    ours = bleu.chrf(HYPS, REFS)
    assert ours.score == pytest.approx(float(cli["score"]), abs=1e-6)
    assert ours.signature == cli["signature"]


def test_moses_tokenizer_escapes_like_tokenizer_perl():
    # tokenizer.perl -l de (no -no-escape, no -a): XML specials escaped, hyphenated words kept whole.
    assert bleu.moses_tokenize_de('Er sagte: "Ja & nein" [sic] | <b> Open-Source') == (
        "Er sagte : &quot; Ja &amp; nein &quot; &#91; sic &#93; &#124; &lt; b &gt; Open-Source")


@pytest.mark.parametrize("line", ["a-b-c", "Open-Source-Projekt", "x - y -z q-", "rich-text format", "E-Mail"])
def test_atat_split_matches_perl(line):
    expected = {"a-b-c": "a ##AT##-##AT## b-c",  # non-overlapping matches: the 'b' is consumed
                "Open-Source-Projekt": "Open ##AT##-##AT## Source ##AT##-##AT## Projekt",
                "x - y -z q-": "x - y -z q-",
                "rich-text format": "rich ##AT##-##AT## text format",
                "E-Mail": "E ##AT##-##AT## Mail"}[line]
    assert bleu.atat_split(line) == expected
    if shutil.which("perl"):  # the regex of get_ende_bleu.sh, run by perl itself
        perl = subprocess.run(["perl", "-ple", r"s{(\S)-(\S)}{$1 ##AT##-##AT## $2}g"], input=line + "\n",
                              capture_output=True, text=True, check=True)
        assert perl.stdout.rstrip("\n") == expected


# Lines where a character-level split and perl's byte-level one differ (or could): a two-byte
# letter between hyphens, a no-break space (C2 A0) and a narrow one (E2 80 AF) beside a hyphen,
# an en dash (not a hyphen), a three-byte and a four-byte character, and plain ASCII.
PERL_LINES = ["vis-à-vis", "a\u00a0-b", "a -\u00a0b", "x\u202f-y", "Jean–Paul", "été-là-bas",
              "日-本-語", "😀-x", "a-b-c", "\u00e0-\u00e0-\u00e0"]


@pytest.mark.skipif(not shutil.which("perl"), reason="perl is not installed")
def test_atat_split_runs_on_bytes_as_perl_does():
    text = "".join(line + "\n" for line in PERL_LINES)
    perl = subprocess.run(["perl", "-ple", r"s{(\S)-(\S)}{$1 ##AT##-##AT## $2}g"], input=text.encode("utf-8"),
                          capture_output=True, check=True)
    expected = perl.stdout.decode("utf-8").split("\n")[:-1]
    assert [bleu.atat_split(line) for line in PERL_LINES] == expected
    # The case the issue found: the character-level regex leaves "à-vis" whole, perl splits it.
    assert expected[0] == "vis ##AT##-##AT## à ##AT##-##AT## vis"
    assert expected[1] == "a\u00a0 ##AT##-##AT## b"  # a no-break space is not perl's \s


def test_tokenized_bleu_for_french_has_no_compound_split():
    hyps, refs = ["C'est un vis-à-vis."], ["C'est un vis-à-vis important."]
    fr = bleu.tokenized_bleu(hyps, refs, "fr", compound_split=False)
    tok = [bleu.moses_tokenize(h, "fr") for h in hyps], [bleu.moses_tokenize(r, "fr") for r in refs]
    assert "##AT##" not in " ".join(tok[0] + tok[1])
    assert fr.score == pytest.approx(bleu.multi_bleu(*tok).score)
    assert "lang=fr" in fr.signature and "ATAT" not in fr.signature
    assert bleu.paper_metric("fr") == "bleu_tok" and bleu.paper_metric("de") == "bleu_tok_cs"


def test_tokenized_compound_split_bleu_by_hand():
    hyps, refs = HYPS[:2], REFS[:2]
    # After Moses + ATAT:
    #   h1: Das Open @ Source @ Projekt läuft gut .        (9 tokens, @ = ##AT##-##AT##)
    #   r1: Das Open @ Source @ Projekt läuft sehr gut .   (10)
    #   h2: Die E @ Mail kam an .                          (7)
    #   r2: Die E @ Mail ist angekommen .                  (7)
    # Matches (clipped), h1 + h2:
    #   1-grams: 9/9 + 5/7 (kam, an miss)                                  = 14/16
    #   2-grams: 7/8 (läuft gut miss) + 3/6 (Die E, E @, @ Mail)           = 10/14
    #   3-grams: 5/7 + 2/5 (Die E @, E @ Mail)                             =  7/12
    #   4-grams: 4/6 + 1/4 (Die E @ Mail)                                  =  5/10
    # BP = exp(1 - 17/16) since c = 16 < r = 17.
    expected = 100 * math.exp(1 - 17 / 16) * (14 / 16 * 10 / 14 * 7 / 12 * 5 / 10) ** 0.25  # 61.383
    got = bleu.tokenized_bleu_cs(hyps, refs)
    assert got.score == pytest.approx(expected, abs=1e-9)
    assert got.score == pytest.approx(61.383, abs=1e-3)
    assert "87.5/71.4/58.3/50.0" in got.detail
    # Compound splitting matters: without ATAT the hyphenated words are single tokens.
    plain = bleu.multi_bleu([bleu.moses_tokenize_de(h) for h in hyps], [bleu.moses_tokenize_de(r) for r in refs])
    assert plain.score != pytest.approx(got.score)


def test_multi_bleu_gives_zero_when_an_order_has_no_match():
    # multi-bleu.perl: log(0) -> -9999999999, BLEU 0. sacreBLEU's default exp smoothing would not.
    assert bleu.multi_bleu(["a b c d"], ["a x b y c z d"]).score == 0.0
    assert bleu.multi_bleu(["a b c d"], ["a b c d"]).score == pytest.approx(100.0)


def test_length_mismatch_is_an_error():
    with pytest.raises(ValueError, match="2 hypotheses but 1 references"):
        bleu.sacre_bleu(["a", "b"], ["a"])
