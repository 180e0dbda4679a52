"""The WMT14 data as the paper used it (§5.1): where each file is, inside which archive.

EN-DE training: Europarl v7 + CommonCrawl + News Commentary v9 (~4.5M pairs). EN-FR training
(~36M pairs after the paper's filtering, 40.8M raw): the same three archives' fr-en members + the UN
corpus + the 10^9 French-English (Giga) corpus. Dev: newstest2013; test: newstest2014, the *full*
3003-sentence version. The test set's URL, md5 and member paths come from sacrebleu's own dataset
registry (``wmt14/full``), so both agree on what "the test set" is.

``data.mirror`` (a URL, an ``s3://`` URI or a local folder with the same relative paths
``wmt13/...``, ``wmt14/...``) replaces ``http(s)://statmt.org/`` for air-gapped clusters and tests.

Multi30k task 1 (Elliott et al., 2016, W16-3210; ``data.source = "multi30k"``): the small published
EN-DE benchmark a CPU can reproduce. Its six gzipped text files come from the ``multi30k/dataset``
repository at a pinned commit, each checked against its sha256; ``data.mirror`` then replaces
``https://github.com/multi30k/dataset/raw/<commit>/`` (a folder with ``data/task1/raw/...``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

STATMT = re.compile(r"^https?://(www\.)?statmt\.org/")
# The WMT14 language pairs this registry knows, each as {"en", other}; either direction works.
PAIRS = ({"en", "de"}, {"en", "fr"})


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


def _sacrebleu_test(langpair: str = "en-de") -> tuple[Archive, dict[str, str]]:
    """newstest2014 (full) from sacrebleu's registry: URL, md5 and the SGML members of ``langpair``
    (``src-tgt``), as {language: member}."""
    from sacrebleu.dataset import DATASETS

    ds = DATASETS["wmt14/full"]
    src, tgt = langpair.split("-")
    src_file, ref_file = ds.langpairs[langpair]
    return Archive(ds.data[0], ds.md5[0] if ds.md5 else None), {src: src_file, tgt: ref_file}


_EUROPARL = Archive("http://statmt.org/wmt13/training-parallel-europarl-v7.tgz")
_COMMONCRAWL = Archive("http://statmt.org/wmt13/training-parallel-commoncrawl.tgz")
_NEWS_COMMENTARY = Archive("http://statmt.org/wmt14/training-parallel-nc-v9.tgz")
_DEV = Archive("http://statmt.org/wmt14/dev.tgz")
_UN = Archive("http://statmt.org/wmt13/training-parallel-un.tgz")
# A plain (uncompressed) tar of two gzip members; ``prepare`` reads ``*.gz`` decompressed.
_GIGA = Archive("http://statmt.org/wmt10/training-giga-fren.tar")


def wmt14(src_lang: str, tgt_lang: str) -> list[Corpus]:
    """The registry of the pair ``{src_lang, tgt_lang}`` (either direction); raises on others."""
    check_langs(src_lang, tgt_lang)
    if {src_lang, tgt_lang} == {"en", "de"}:
        return wmt14_en_de()
    return wmt14_en_fr(f"{src_lang}-{tgt_lang}")


def wmt14_en_de() -> list[Corpus]:
    """Every file of WMT14 EN-DE, training corpora first, in a fixed order (it fixes ``idx``)."""
    # The en-de pair of files serves both directions: ref.de.sgm / src.en.sgm carry the same
    # text as src.de.sgm / ref.en.sgm (3003/3003 segments, shared/data/PROVENANCE.md).
    test_archive, test_members = _sacrebleu_test("en-de")
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


def wmt14_en_fr(langpair: str = "en-fr") -> list[Corpus]:
    """Every file of WMT14 EN-FR (§5.1: "the significantly larger WMT 2014 English-French dataset
    consisting of 36M sentences"), training corpora first, in a fixed order (it fixes ``idx``).

    The archives and members are those of fairseq's prepare-wmt14en2fr.sh, tensor2tensor's
    ``_ENFR_TRAIN_LARGE_DATA`` and TFDS's wmt14 (shared/data/PROVENANCE-enfr.md). The test set
    follows sacrebleu's ``langpair`` files (en-fr: src.en + ref.fr; fr-en: src.fr + ref.en), since
    newstest2014 fr-en has one source and one reference per direction.
    """
    test_archive, test_members = _sacrebleu_test(langpair)
    return [
        Corpus("europarl_v7", "train", _EUROPARL,
               {"en": "training/europarl-v7.fr-en.en", "fr": "training/europarl-v7.fr-en.fr"}),
        Corpus("commoncrawl", "train", _COMMONCRAWL,
               {"en": "commoncrawl.fr-en.en", "fr": "commoncrawl.fr-en.fr"}),
        Corpus("un", "train", _UN, {"en": "un/undoc.2000.fr-en.en", "fr": "un/undoc.2000.fr-en.fr"}),
        Corpus("news_commentary_v9", "train", _NEWS_COMMENTARY,
               {"en": "training/news-commentary-v9.fr-en.en", "fr": "training/news-commentary-v9.fr-en.fr"}),
        Corpus("giga_fren", "train", _GIGA,
               {"en": "giga-fren.release2.fixed.en.gz", "fr": "giga-fren.release2.fixed.fr.gz"}),
        Corpus("newstest2013", "dev", _DEV, {"en": "dev/newstest2013.en", "fr": "dev/newstest2013.fr"}),
        Corpus("newstest2014", "test", test_archive, test_members),
    ]


MULTI30K_COMMIT = "a3d2e0d26b56f3846f66a952536ffed4e401d05a"
MULTI30K = re.compile(r"^https://github\.com/multi30k/dataset/raw/[0-9a-f]{40}/")
# (split, the repository's file stem): train (29,000 pairs), val (1,014) as dev, test_2016_flickr (1,000).
MULTI30K_SPLITS = (("train", "train"), ("dev", "val"), ("test", "test_2016_flickr"))
# sha256 of data/task1/raw/<stem>.<lang>.gz at MULTI30K_COMMIT (unchanged since c9be912, 2018-01-17).
MULTI30K_SHA256 = {
    "train.en": "d79cfa999dd4c51d2cb42499b6796d5a882c3a8a961923c25a898c90f8bbd56f",
    "train.de": "726e39b2fa9eb9ffb6dc763fb35a179f80fae06ffc5d28b6ace5faa883de28a6",
    "val.en": "14f7d25ddd868909a9213e361768460edcacdd6ab9d1e77b92560dc10c10dc28",
    "val.de": "f0cba2f995189cf5770f29a8a9a537a3ad3f51657ad873405082ff6863a5e75a",
    "test_2016_flickr.en": "611d361c6334bc7246101d48097c13cf5c4413c5befc793cc629934359d532d9",
    "test_2016_flickr.de": "9204244e408ccb38d2a55cfcd344df15005fc42a07a6e55ca6c52b6ababb8cc8",
}


@dataclass(frozen=True)
class TextFile:
    """One gzipped text file of a source that ships plain files, not archives (Multi30k)."""

    url: str
    sha256: str

    @property
    def relpath(self) -> str:
        """``data/task1/raw/train.en.gz``: the path under the repository, and so under a mirror."""
        return MULTI30K.sub("", self.url)


@dataclass(frozen=True)
class FilePair:
    name: str  # "multi30k_train"
    split: str  # "train" | "dev" | "test"
    files: dict[str, TextFile]  # language -> file


def multi30k(src_lang: str, tgt_lang: str) -> list[FilePair]:
    """Multi30k task 1's train, val (dev) and test_2016_flickr (test) files for en-de or de-en."""
    if {src_lang, tgt_lang} != {"en", "de"} or src_lang == tgt_lang:
        raise ValueError(f"data.src_lang/data.tgt_lang: Multi30k task 1 here is en-de or de-en, "
                         f"got {src_lang}-{tgt_lang}")
    base = f"https://github.com/multi30k/dataset/raw/{MULTI30K_COMMIT}/data/task1/raw/"
    return [FilePair(f"multi30k_{stem}", split,
                     {lang: TextFile(f"{base}{stem}.{lang}.gz", MULTI30K_SHA256[f"{stem}.{lang}"])
                      for lang in (src_lang, tgt_lang)})
            for split, stem in MULTI30K_SPLITS]


def check_langs(src_lang: str, tgt_lang: str) -> None:
    if {src_lang, tgt_lang} not in PAIRS or src_lang == tgt_lang:
        raise ValueError(f"data.src_lang/data.tgt_lang: WMT14 here is en-de, de-en, en-fr or fr-en, "
                         f"got {src_lang}-{tgt_lang}")


def chosen(corpora: list[Corpus], names: list[str]) -> list[Corpus]:
    """``corpora`` with the training corpora cut to ``names`` (``data.corpora``; empty = all of them,
    the paper's data), in the registry's order; dev and test kept. A name the registry lacks is an
    error naming the ones it has."""
    if not names:
        return corpora
    known = [c.name for c in corpora if c.split == "train"]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"data.corpora: no training corpus {', '.join(map(repr, unknown))} here; "
                         f"this language pair has {', '.join(known)}")
    return [c for c in corpora if c.split != "train" or c.name in names]


def archives(corpora: list[Corpus]) -> list[Archive]:
    """The distinct archives, in first-use order."""
    out: dict[str, Archive] = {}
    for c in corpora:
        out.setdefault(c.archive.url, c.archive)
    return list(out.values())


def location(archive: Archive | TextFile, mirror: str) -> str:
    """Where to fetch ``archive`` from: its canonical URL, or the same relative path under ``mirror``."""
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
