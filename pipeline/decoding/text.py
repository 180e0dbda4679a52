"""The text a model reads and writes: a benchmark's preprocessing (``data.preprocess``).

``"lowercase_moses"`` is Multi30k's ``scripts/task1-tokenize.sh`` (multi30k/dataset), run per
language on each side::

    lowercase.perl | normalize-punctuation.perl -l LANG | tokenizer.perl -l LANG

with sacremoses' ports of the three Moses scripts (``str.lower``, ``MosesPunctNormalizer``,
``MosesTokenizer`` with its default escaping, as tokenizer.perl escapes by default). Published
Multi30k BLEU (e.g. fairseq Transformer-tiny, 41.02 on test_2016_flickr) is computed on this text.

``prepare`` applies it to every split (``pipeline/data/preprocess.py``); a model trained on such
text reads only such text, so whatever translates a user's sentences with it (the translate CLI,
Ray Serve, the registered pyfunc) applies it too (``TextFormat.sources``) and gives back
``TextFormat.output``: the model's output Moses-detokenized (``&apos;`` -> ``'``, ``dog .`` ->
``dog.``), still lowercased (what the model learned). Pure: no Ray.
"""

from __future__ import annotations

import functools
import typing
from dataclasses import asdict, dataclass
from typing import Any

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


@dataclass(frozen=True)
class TextFormat:
    """How a model's text differs from a user's: ``data.preprocess`` and the languages."""

    preprocess: str = "none"
    src_lang: str = "en"
    tgt_lang: str = "de"

    def __post_init__(self) -> None:
        if self.preprocess not in KINDS:
            raise ValueError(f"preprocess={self.preprocess!r}: expected one of {KINDS}")

    @classmethod
    def of(cls, value: "TextFormat | dict[str, Any] | None") -> "TextFormat":
        if isinstance(value, TextFormat):
            return value
        return cls(**(value or {}))

    @classmethod
    def of_config(cls, cfg: Any) -> "TextFormat":
        return cls(cfg.data.preprocess, cfg.data.src_lang, cfg.data.tgt_lang)

    def to_dict(self) -> dict[str, str]:
        return asdict(self)

    def sources(self, lines: list[str]) -> list[str]:
        """A user's sentences as the model's training text was."""
        return preprocess_lines(lines, self.preprocess, self.src_lang)

    def output(self, hyp: str) -> str:
        """The model's output for a reader: Moses-detokenized where the training text was tokenized."""
        if self.preprocess == "none":
            return hyp
        from pipeline.decoding.bleu import moses_detokenize

        return moses_detokenize(hyp, self.tgt_lang)
