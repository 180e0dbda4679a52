"""The encode stage's ids (pipeline/data/encode.py, `Encoder`) against SentencePiece itself.

A tiny SentencePiece model is trained here, with the vocab stage's own settings
(`pipeline.data.vocab.train_spm`: pad 0, unk 1, bos 2, eos 3); then every row's ids are compared
with `sentencepiece.SentencePieceProcessor.encode` run directly, one row at a time, on that row's
text: text the model never saw, characters outside its alphabet (unk), empty and blank lines,
NFKC-normalized forms, a batch that mixes the three splits. Ids are pieces only (no bos/eos).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import sentencepiece as spm

from pipeline.data.encode import Encoder
from pipeline.data.vocab import train_spm

TRAIN_TEXT = [
    "The committee approved the budget for the coming year.",
    "Der Ausschuss hat den Haushalt für das kommende Jahr gebilligt.",
    "Negotiations between the two parties continued late into the night.",
    "Die Verhandlungen zwischen den beiden Parteien dauerten bis spät in die Nacht.",
    "A spokesman said the results would be published on Monday.",
    "Ein Sprecher sagte, die Ergebnisse würden am Montag veröffentlicht.",
    "Prices rose by 3.5 percent in the first quarter of 2013.",
    "Die Preise stiegen im ersten Quartal 2013 um 3,5 Prozent.",
]

ROWS = [  # (split, source, target): unseen words, unk characters, empty and odd whitespace, NFKC forms
    ("train", "The committee met on Monday.", "Der Ausschuss tagte am Montag."),
    ("train", "Zebras quickly jumped over 42 lazy dogs!", "Zwölf Boxkämpfer jagen Viktor quer über den Sylter Deich."),
    ("dev", "", "   "),
    ("dev", "Prices   rose\tsharply ©2014 — “quoted” 株価", "Die ﬁnanzielle Lage (Ⅻ) ist ½ so gut."),
    ("test", "naïve café résumé", "Straße, Maß und Fuß"),
    ("test", "😀 emoji and ∑ math ≠ text", "ÄÖÜ äöü ß"),
]


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory) -> str:
    tmp = tmp_path_factory.mktemp("spm")
    sample = tmp / "sample.txt"
    sample.write_text("\n".join(TRAIN_TEXT * 20) + "\n", encoding="utf-8")
    train_spm(sample, tmp / "spm", size=120, model_type="bpe", character_coverage=1.0, num_threads=1)
    return str(tmp / "spm.model")


def batch(split_dirs: dict[str, str]) -> pa.Table:
    folder = {split: d for d, split in split_dirs.items()}
    return pa.table({"idx": pa.array(range(len(ROWS)), pa.int64()),
                     "src": [r[1] for r in ROWS], "tgt": [r[2] for r in ROWS],
                     "path": [f"{folder[r[0]]}/part-00000.parquet" for r in ROWS]})


def test_ids_equal_sentencepieces_own_encoding_of_each_rows_text(spm_model, tmp_path):
    split_dirs = {str(tmp_path / s): s for s in ("train", "dev", "test")}
    out = Encoder(spm_model, split_dirs, num_threads=2)(batch(split_dirs))
    sp = spm.SentencePieceProcessor(model_file=spm_model)
    assert out.column("split").to_pylist() == [r[0] for r in ROWS]
    assert out.column("idx").to_pylist() == list(range(len(ROWS)))
    for i, (_, src, tgt) in enumerate(ROWS):
        want_src, want_tgt = sp.encode(src), sp.encode(tgt)
        assert out.column("src_ids")[i].as_py() == want_src, src
        assert out.column("tgt_ids")[i].as_py() == want_tgt, tgt
        assert out.column("src_len")[i].as_py() == len(want_src) and out.column("tgt_len")[i].as_py() == len(want_tgt)
    ids = np.concatenate([np.asarray(out.column(c)[i].as_py(), dtype=np.int64)
                          for c in ("src_ids", "tgt_ids") for i in range(len(ROWS))])
    assert (ids >= 4).sum() > 0 and not np.isin(ids, [0, 2, 3]).any(), "pieces only: no pad, bos or eos"
    assert (ids == sp.unk_id()).any(), "the unk characters really were out of the alphabet"
    assert out.column("src").to_pylist()[:2] == [None, None], "train text is not kept"
    assert out.column("src").to_pylist()[2:] == [r[1] for r in ROWS[2:]]
