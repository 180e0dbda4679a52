"""Cleaning rules, chunked pair reading, SGML, dedup: the pure parts of ``prepare``."""

from __future__ import annotations

import pyarrow as pa
import pytest

from pipeline.data.fetch import DataError
from pipeline.data.prepare import clean_corpus
from pipeline.data.clean import (TEXT_SCHEMA, ReadReport, clean_batch, pair_hashes, read_pair_chunks,
                                 rule_masks, sgml_lines)


def _table(pairs: list[tuple[str, str]]) -> pa.Table:
    return pa.table({"corpus": ["c"] * len(pairs), "line": list(range(1, len(pairs) + 1)),
                     "src": [s for s, _ in pairs], "tgt": [t for _, t in pairs]}, schema=TEXT_SCHEMA)


HAND_MADE = [
    ("a good pair", "ein gutes Paar"),  # kept
    ("  padded  ", " gepolstert "),  # kept, trimmed
    ("", "nur rechts"),  # empty
    ("   ", "leer"),  # empty (whitespace only)
    ("bell\x07char", "Glocke"),  # invalid_text (C0 control)
    ("ok", "kaputt \ufffd"),  # invalid_text (replacement char)
    ("c1 \x92 control", "C1"),  # invalid_text (C1 control, cp1252 mojibake)
    ("\x07", ""),  # invalid_text wins over empty (rule order)
    (" ".join(["w"] * 6), " ".join(["w"] * 6)),  # too_long (max_words=5)
    ("one", "eins zwei drei vier"),  # length_ratio (4 > 3 * 1)
    ("one two", "eins zwei drei vier fuenf sechs"),  # too_long wins over length_ratio
    ("x\ty", "x\u00a0y z"),  # kept: tab and NBSP are whitespace, ratio 1.5
]


def test_clean_batch_counts_each_rule_once():
    kept, counts = clean_batch(_table(HAND_MADE), max_words=5, max_length_ratio=3.0)
    assert counts == {"invalid_text": 4, "empty": 2, "too_long": 2, "length_ratio": 1}
    assert kept.num_rows + sum(counts.values()) == len(HAND_MADE)
    assert kept.column("src").to_pylist() == ["a good pair", "padded", "x\ty"]
    assert kept.column("tgt").to_pylist() == ["ein gutes Paar", "gepolstert", "x\u00a0y z"]
    assert kept.column("line").to_pylist() == [1, 2, 12]


def test_test_split_is_flagged_never_changed():
    table = _table(HAND_MADE)
    same, counts = clean_batch(table, max_words=5, max_length_ratio=3.0, drop=False)
    assert same.equals(table)
    assert counts == {"invalid_text": 4, "empty": 2, "too_long": 2, "length_ratio": 1}


def test_word_counts_agree_with_python_split():
    texts = ["a  b", " x y ", "a\u00a0b\u3000c", "a\tb", "\u2009x\u2009", "über straße", "eins"]
    masks = rule_masks(_table([(t, "y") for t in texts]), max_words=2, max_length_ratio=100.0)
    assert masks["too_long"].tolist() == [len(t.split()) > 2 for t in texts]


def test_pair_hashes_are_over_both_columns():
    # ("ab", "c") and ("a", "bc") must not collide: the hash is over the two columns.
    assert len(set(pair_hashes(_table([("ab", "c"), ("a", "bc")])).tolist())) == 2


def _write(path, lines: list[bytes]) -> str:
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return str(path)


def test_read_pair_chunks_chunks_and_line_numbers(tmp_path):
    src = _write(tmp_path / "a.en", [f"s{i}".encode() for i in range(7)])
    tgt = _write(tmp_path / "a.de", [f"t{i}\r".encode() for i in range(7)])  # CRLF lines
    chunks = list(read_pair_chunks("c", src, tgt, chunk_lines=3))
    assert [c.num_rows for c in chunks] == [3, 3, 1]
    table = pa.concat_tables(chunks)
    assert table.column("line").to_pylist() == list(range(1, 8))
    assert table.column("tgt").to_pylist() == [f"t{i}" for i in range(7)]
    report = ReadReport()
    first = list(read_pair_chunks("c", src, tgt, chunk_lines=10, max_lines=2, report=report))
    assert first[0].column("src").to_pylist() == ["s0", "s1"] and report.num_lines == 7


@pytest.mark.parametrize("n_src, n_tgt", [(5, 4), (4, 5)])
def test_misaligned_files_name_both_files_and_counts(tmp_path, n_src, n_tgt):
    src = _write(tmp_path / "x.en", [b"a"] * n_src)
    tgt = _write(tmp_path / "x.de", [b"b"] * n_tgt)
    with pytest.raises(DataError, match=rf"x\.en has {n_src} lines but .*x\.de has {n_tgt}"):
        list(read_pair_chunks("c", src, tgt, chunk_lines=2, max_lines=1))


def test_invalid_utf8_is_counted_in_train_and_an_error_in_test(tmp_path, caplog):
    src = _write(tmp_path / "bad.en", [b"fine", b"caf\xe9 latin-1", b"also fine"])
    tgt = _write(tmp_path / "bad.de", [b"gut", b"Kaffee", b"auch gut"])
    summary = clean_corpus("train", "c", src, tgt, str(tmp_path / "stage"), max_words=10, max_length_ratio=3.0)
    assert summary["counts"]["invalid_text"] == 1 and summary["num_kept"] == 2
    assert summary["invalid_utf8"] == [f"{src}:2"]
    assert f"{src}:2: invalid UTF-8" in caplog.text
    with pytest.raises(DataError, match=r"bad\.en:2: invalid UTF-8"):
        clean_corpus("test", "c", src, tgt, str(tmp_path / "stage2"), max_words=10, max_length_ratio=3.0)


def test_empty_corpus_after_cleaning_is_an_error_naming_the_files(tmp_path):
    src = _write(tmp_path / "e.en", [b"", b"x \x01"])
    tgt = _write(tmp_path / "e.de", [b"a", b"b"])
    with pytest.raises(DataError, match=r"train corpus c is empty after cleaning: 2 pairs read from .*e\.en and "):
        clean_corpus("train", "c", src, tgt, str(tmp_path / "stage"), max_words=10, max_length_ratio=3.0)


def test_test_split_keeps_empty_lines(tmp_path):
    src = _write(tmp_path / "t.en", [b"a", b"", b"c"])
    tgt = _write(tmp_path / "t.de", [b"x", b"y", b""])
    summary = clean_corpus("test", "t", src, tgt, str(tmp_path / "stage"), max_words=10, max_length_ratio=3.0)
    assert summary["num_kept"] == 3 and summary["counts"]["empty"] == 2


def test_sgml_parse_equals_plain_newstest2014(wmt14_dir):
    for lang, sgm in (("en", "newstest2014-deen-src.en.sgm"), ("de", "newstest2014-deen-ref.de.sgm")):
        lines = list(sgml_lines(str(wmt14_dir / sgm)))
        assert len(lines) == 3003
        assert b"".join(line + b"\n" for line in lines) == (wmt14_dir / f"newstest2014.{lang}").read_bytes()


def test_invalid_utf8_in_sgml_names_file_and_line(tmp_path):
    sgm = tmp_path / "bad.sgm"
    sgm.write_bytes(b'<doc docid="d">\n<seg id="1">fine</seg>\n<seg id="2">caf\xe9</seg>\n</doc>\n')
    with pytest.raises(DataError, match=r"bad\.sgm:3: invalid UTF-8"):
        list(sgml_lines(str(sgm)))
