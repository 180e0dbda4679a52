"""The WMT14 registry: URLs, members, mirror mapping, checksum lists."""

from __future__ import annotations

import pytest

from pipeline.data import sources


def test_registry_matches_the_paper_data():
    corpora = sources.wmt14_en_de()
    assert [(c.name, c.split) for c in corpora] == [
        ("europarl_v7", "train"), ("commoncrawl", "train"), ("news_commentary_v9", "train"),
        ("newstest2013", "dev"), ("newstest2014", "test")]
    by_name = {c.name: c for c in corpora}
    assert by_name["europarl_v7"].archive.url == "http://statmt.org/wmt13/training-parallel-europarl-v7.tgz"
    assert by_name["commoncrawl"].members == {"en": "commoncrawl.de-en.en", "de": "commoncrawl.de-en.de"}
    assert by_name["news_commentary_v9"].archive.relpath == "wmt14/training-parallel-nc-v9.tgz"
    assert by_name["newstest2013"].members["de"] == "dev/newstest2013.de"


def test_test_set_comes_from_sacrebleus_registry():
    from sacrebleu.dataset import DATASETS

    test = sources.wmt14_en_de()[-1]
    ds = DATASETS["wmt14/full"]
    assert test.archive.url == ds.data[0]
    assert test.archive.md5 == ds.md5[0]
    assert test.archive.relpath == "wmt14/test-full.tgz"
    assert test.members == {"en": "test-full/newstest2014-deen-src.en.sgm",
                            "de": "test-full/newstest2014-deen-ref.de.sgm"}


@pytest.mark.parametrize("mirror, expected", [
    ("", "http://statmt.org/wmt14/dev.tgz"),
    ("/data/statmt", "/data/statmt/wmt14/dev.tgz"),
    ("http://127.0.0.1:8000/", "http://127.0.0.1:8000/wmt14/dev.tgz"),
    ("s3://bucket/statmt", "s3://bucket/statmt/wmt14/dev.tgz"),
])
def test_mirror_replaces_statmt(mirror, expected):
    assert sources.location(sources.Archive("http://statmt.org/wmt14/dev.tgz"), mirror) == expected
    assert sources.Archive("https://www.statmt.org/wmt14/dev.tgz").relpath == "wmt14/dev.tgz"


def test_archives_are_distinct_and_ordered():
    urls = [a.url for a in sources.archives(sources.wmt14_en_de())]
    assert len(urls) == len(set(urls)) == 5
    assert urls[0].endswith("europarl-v7.tgz") and urls[-1].endswith("test-full.tgz")


def test_parse_sha256sums(mirror_dir):
    text = "\n".join([
        "9de2a975532206ede4c887b9320ad8663f3020b15d6be72816bef7de7b025af7  ./wmt13/training-parallel-europarl-v7.tgz",
        "60606B2DB550BE0EE94ED8A8410DAA4B92A3DD65912FB9513F0D2752CE0D1F31 *wmt14/dev.tgz",
        "not a checksum line", ""])
    assert sources.parse_sha256sums(text) == {
        "wmt13/training-parallel-europarl-v7.tgz": "9de2a975532206ede4c887b9320ad8663f3020b15d6be72816bef7de7b025af7",
        "wmt14/dev.tgz": "60606b2db550be0ee94ed8a8410daa4b92a3dd65912fb9513f0d2752ce0d1f31"}
    sums = sources.parse_sha256sums((mirror_dir / "SHA256SUMS").read_text())
    # The mirror holds exactly the archives of both registries: EN-DE's, and EN-FR's (UN, Giga more).
    en_de = {a.relpath for a in sources.archives(sources.wmt14_en_de())}
    en_fr = {a.relpath for a in sources.archives(sources.wmt14_en_fr())}
    assert set(sums) == en_de | en_fr
    assert en_fr - en_de == {"wmt13/training-parallel-un.tgz", "wmt10/training-giga-fren.tar"}


def test_languages_are_checked():
    sources.check_langs("de", "en")
    sources.check_langs("fr", "en")
    for src, tgt in (("en", "cs"), ("de", "fr"), ("en", "en")):
        with pytest.raises(ValueError, match=f"got {src}-{tgt}"):
            sources.check_langs(src, tgt)


def test_en_fr_registry_is_the_papers_data():
    """§5.1's EN-FR corpora with the member paths of fairseq/t2t/TFDS (shared/data/PROVENANCE-enfr.md)."""
    corpora = sources.wmt14("en", "fr")
    assert [(c.name, c.split) for c in corpora] == [
        ("europarl_v7", "train"), ("commoncrawl", "train"), ("un", "train"), ("news_commentary_v9", "train"),
        ("giga_fren", "train"), ("newstest2013", "dev"), ("newstest2014", "test")]
    by_name = {c.name: c for c in corpora}
    assert by_name["un"].archive.url == "http://statmt.org/wmt13/training-parallel-un.tgz"
    assert by_name["giga_fren"].archive.url == "http://statmt.org/wmt10/training-giga-fren.tar"
    assert by_name["giga_fren"].members == {"en": "giga-fren.release2.fixed.en.gz",
                                            "fr": "giga-fren.release2.fixed.fr.gz"}
    assert by_name["europarl_v7"].archive == sources.wmt14_en_de()[0].archive  # one archive, both pairs
    assert by_name["europarl_v7"].members["fr"] == "training/europarl-v7.fr-en.fr"
    assert by_name["newstest2013"].members == {"en": "dev/newstest2013.en", "fr": "dev/newstest2013.fr"}


@pytest.mark.parametrize("src, tgt", [("en", "fr"), ("fr", "en")])
def test_en_fr_test_set_follows_sacrebleu_per_direction(src, tgt):
    from sacrebleu.dataset import DATASETS

    test = sources.wmt14(src, tgt)[-1]
    src_file, ref_file = DATASETS["wmt14/full"].langpairs[f"{src}-{tgt}"]
    assert test.members == {src: src_file, tgt: ref_file}
    assert test.members[src] == f"test-full/newstest2014-fren-src.{src}.sgm"
    assert test.members[tgt] == f"test-full/newstest2014-fren-ref.{tgt}.sgm"


def test_en_fr_members_are_in_the_mirror(mirror_dir):
    """Every member the registry names is in the mirror's archive of the same relative path."""
    import tarfile

    for archive in sources.archives(sources.wmt14_en_fr()):
        with tarfile.open(mirror_dir / archive.relpath) as tar:
            names = {n.removeprefix("./") for n in tar.getnames()}
        wanted = {m for c in sources.wmt14_en_fr() if c.archive == archive for m in c.members.values()}
        assert wanted <= names, (archive.relpath, wanted - names)
