"""The WMT14 EN-DE data as the paper used it (§5.1): where each file is, inside which archive.

Training: Europarl v7 + CommonCrawl + News Commentary v9 (~4.5M pairs); dev: newstest2013;
test: newstest2014, the *full* 3003-sentence version. The test set's URL, md5 and member paths
come from sacrebleu's own dataset registry (``wmt14/full``), so both agree on what "the test set" is.

``data.mirror`` (a URL, an ``s3://`` URI or a local folder with the same relative paths
``wmt13/...``, ``wmt14/...``) replaces ``http(s)://statmt.org/`` for air-gapped clusters and tests.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

STATMT = re.compile(r"^https?://(www\.)?statmt\.org/")
LANGS = ("en", "de")


@dataclass(frozen=True)
class Archive:
    url: str  # the canonical statmt.org URL
    md5: str | None = None  # of the real statmt.org file, where a maintained source publishes one

    @property
    def relpath(self) -> str:
        """``wmt14/dev.tgz``: the path under statmt.org, and so under a mirror."""
        return STATMT.sub("", self.url)


@dataclass(frozen=True)
class Corpus:
    name: str
    split: str  # "train" | "dev" | "test"
    archive: Archive
    members: dict[str, str]  # language -> member path inside the archive


def _sacrebleu_test() -> tuple[Archive, dict[str, str]]:
    """newstest2014 (full) from sacrebleu's registry: URL, md5 and the en-de SGML members."""
    from sacrebleu.dataset import DATASETS

    ds = DATASETS["wmt14/full"]
    src_en, ref_de = ds.langpairs["en-de"]
    # The en-de pair of files serves both directions: ref.de.sgm / src.en.sgm carry the same
    # text as src.de.sgm / ref.en.sgm (3003/3003 segments, shared/data/PROVENANCE.md).
    return Archive(ds.data[0], ds.md5[0] if ds.md5 else None), {"en": src_en, "de": ref_de}


_EUROPARL = Archive("http://statmt.org/wmt13/training-parallel-europarl-v7.tgz")
_COMMONCRAWL = Archive("http://statmt.org/wmt13/training-parallel-commoncrawl.tgz")
_NEWS_COMMENTARY = Archive("http://statmt.org/wmt14/training-parallel-nc-v9.tgz")
_DEV = Archive("http://statmt.org/wmt14/dev.tgz")


def wmt14_en_de() -> list[Corpus]:
    """Every file of WMT14 EN-DE, training corpora first, in a fixed order (it fixes ``idx``)."""
    test_archive, test_members = _sacrebleu_test()
    return [
        Corpus("europarl_v7", "train", _EUROPARL,
               {"en": "training/europarl-v7.de-en.en", "de": "training/europarl-v7.de-en.de"}),
        Corpus("commoncrawl", "train", _COMMONCRAWL,
               {"en": "commoncrawl.de-en.en", "de": "commoncrawl.de-en.de"}),
        Corpus("news_commentary_v9", "train", _NEWS_COMMENTARY,
               {"en": "training/news-commentary-v9.de-en.en", "de": "training/news-commentary-v9.de-en.de"}),
        Corpus("newstest2013", "dev", _DEV, {"en": "dev/newstest2013.en", "de": "dev/newstest2013.de"}),
        Corpus("newstest2014", "test", test_archive, test_members),
    ]


def check_langs(src_lang: str, tgt_lang: str) -> None:
    if {src_lang, tgt_lang} != set(LANGS):
        raise ValueError(f"data.src_lang/data.tgt_lang: WMT14 here is en-de or de-en, got {src_lang}-{tgt_lang}")


def archives(corpora: list[Corpus]) -> list[Archive]:
    """The distinct archives, in first-use order."""
    out: dict[str, Archive] = {}
    for c in corpora:
        out.setdefault(c.archive.url, c.archive)
    return list(out.values())


def location(archive: Archive, mirror: str) -> str:
    """Where to fetch ``archive`` from: the statmt.org URL, or the same relative path under ``mirror``."""
    if not mirror:
        return archive.url
    return mirror.rstrip("/") + "/" + archive.relpath


def parse_sha256sums(text: str) -> dict[str, str]:
    """``sha256sum`` output (``HASH  ./wmt14/dev.tgz``) -> {"wmt14/dev.tgz": HASH}."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.strip().split(None, 1)
        if len(parts) != 2 or not re.fullmatch(r"[0-9a-fA-F]{64}", parts[0]):
            continue
        name = parts[1].lstrip("*")  # "*" marks binary mode
        while name.startswith("./"):
            name = name[2:]
        out[name] = parts[0].lower()
    return out
