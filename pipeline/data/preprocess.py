"""A benchmark's own text preprocessing, applied by ``prepare`` to every split (``data.preprocess``).

``"lowercase_moses"`` is Multi30k's ``scripts/task1-tokenize.sh`` (multi30k/dataset), run per
language on each side::

    lowercase.perl | normalize-punctuation.perl -l LANG | tokenizer.perl -l LANG

with sacremoses' ports of the three Moses scripts (``str.lower``, ``MosesPunctNormalizer``,
``MosesTokenizer`` with its default escaping, as tokenizer.perl escapes by default). Published
Multi30k BLEU (e.g. fairseq Transformer-tiny, 41.02 on test_2016_flickr) is computed on this text;
the dataset's own ``tok/*.lc.norm.tok.*`` files are the reference the tests compare with.

Pure: no Ray. The test split is changed here too (a benchmark defines its references this way);
``score`` reads the raw reference from ``download``'s files for the cased sacreBLEU beside it.
"""

from __future__ import annotations

import functools
import typing

import pyarrow as pa

from pipeline.config import Preprocess

KINDS = typing.get_args(Preprocess)


@functools.lru_cache(maxsize=8)
def _moses(lang: str):
    from sacremoses import MosesPunctNormalizer, MosesTokenizer

    return MosesPunctNormalizer(lang=lang), MosesTokenizer(lang=lang)


def lowercase_moses(line: str, lang: str) -> str:
    """One line as task1-tokenize.sh writes it: lowercased, punctuation-normalized, Moses-tokenized."""
    norm, tok = _moses(lang)
    return tok.tokenize(norm.normalize(line.lower()), escape=True, return_str=True)


def preprocess_lines(lines: list[str], kind: str, lang: str) -> list[str]:
    if kind == "none":
        return lines
    if kind == "lowercase_moses":
        return [lowercase_moses(line, lang) for line in lines]
    raise ValueError(f"data.preprocess: unknown kind {kind!r} (expected one of {KINDS})")


def preprocess_table(table: pa.Table, kind: str, src_lang: str, tgt_lang: str) -> pa.Table:
    """``table`` with its ``src`` and ``tgt`` columns preprocessed (other columns unchanged)."""
    if kind == "none":
        return table
    for col, lang in (("src", src_lang), ("tgt", tgt_lang)):
        i = table.schema.get_field_index(col)
        values = preprocess_lines(table.column(col).to_pylist(), kind, lang)
        table = table.set_column(i, col, pa.array(values, pa.string()))
    return table
