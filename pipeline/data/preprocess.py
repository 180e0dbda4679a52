"""A benchmark's own text preprocessing, applied by ``prepare`` to every split (``data.preprocess``):
``pipeline/decoding/text.py`` (``lowercase_moses``: Multi30k's ``scripts/task1-tokenize.sh``), the
one definition, which the translate CLI and the server apply to a user's sentences as well. The
test split is changed here too (a benchmark defines its references this way); ``score`` reads the
raw reference from ``download``'s files for the cased sacreBLEU beside it. Pure: no Ray.
"""

from __future__ import annotations

import pyarrow as pa

from pipeline.decoding.text import preprocess_lines


def preprocess_table(table: pa.Table, kind: str, src_lang: str, tgt_lang: str) -> pa.Table:
    """``table`` with its ``src`` and ``tgt`` columns preprocessed (other columns unchanged)."""
    if kind == "none":
        return table
    for col, lang in (("src", src_lang), ("tgt", tgt_lang)):
        i = table.schema.get_field_index(col)
        values = preprocess_lines(table.column(col).to_pylist(), kind, lang)
        table = table.set_column(i, col, pa.array(values, pa.string()))
    return table
