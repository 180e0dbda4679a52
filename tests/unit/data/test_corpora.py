"""`data.corpora`: a run downloads the archives of the training corpora it reads, and nothing else.

Local mode (configs/local.toml) reads News Commentary alone. Against a mirror served over HTTP on
127.0.0.1 (statmt.org's layout, generated text: tests/support/synthetic_mirror.py), its download stage
asks for that archive, dev.tgz, test-full.tgz and the mirror's SHA256SUMS, and reads no byte of
Europarl or CommonCrawl (the paper's other 1.5 GB).
"""

from __future__ import annotations

import functools
import http.server
from pathlib import Path

import pytest

from pipeline.config import ConfigError, load_config
from pipeline.data import download, sources
from pipeline.data.fetch import copy_stream
from pipeline.stage import StageContext
from tests.support.http import serve
from workflows.preflight import check_corpora


class _CountingHandler(http.server.SimpleHTTPRequestHandler):
    """Serves the mirror and records, per path, the body bytes it sent."""

    sent: dict[str, int]

    def copyfile(self, source, outputfile):
        self.sent[self.path] = self.sent.get(self.path, 0) + copy_stream(source, outputfile)

    def log_message(self, *args):
        pass


def _download(cfg, out: Path):
    return download.run(StageContext(name="download", key="k", cfg=cfg, out_dir=str(out), inputs={}))


def test_local_mode_downloads_news_commentary_dev_and_test_only(synthetic_mirror, tmp_path):
    sent: dict[str, int] = {}
    handler = type("Handler", (_CountingHandler,), {"sent": sent})
    with serve(functools.partial(handler, directory=str(synthetic_mirror))) as url:
        cfg = load_config("configs/local.toml", [f"--data.mirror={url}/", f"--run.work_dir={tmp_path}"])
        result = _download(cfg, tmp_path / "out")

    archives = {"/wmt14/training-parallel-nc-v9.tgz", "/wmt14/dev.tgz", "/wmt14/test-full.tgz"}
    assert set(sent) == archives | {"/SHA256SUMS"}
    sizes = {p: (synthetic_mirror / p.lstrip("/")).stat().st_size for p in archives}
    assert {p: sent[p] for p in archives} == sizes  # each read once, whole
    assert result.metrics["download/bytes"] == sum(sizes.values())
    assert [c["corpus"] for c in result.outputs["train"]] == ["news_commentary_v9"]
    assert Path(result.outputs["train"][0]["src"]).read_text().splitlines()  # the text is there


def test_the_paper_reads_every_corpus_and_the_key_is_unchanged_when_unset():
    from pipeline.dag import compute_keys

    paper = load_config(None, [])
    assert paper.data.corpora == []
    assert [c.name for c in sources.chosen(sources.wmt14("en", "de"), paper.data.corpora)] == [
        "europarl_v7", "commoncrawl", "news_commentary_v9", "newstest2013", "newstest2014"]
    # Naming every corpus reads the same files but is a different config; left empty, the key is the
    # one work dirs made before the field existed have (tests/fixtures/cache_keys.json pins those).
    named = load_config(None, ["--data.corpora=europarl_v7,commoncrawl,news_commentary_v9"])
    assert compute_keys(named)["download"] != compute_keys(paper)["download"]
    assert compute_keys(load_config(None, ["--data.corpora="]))["download"] == compute_keys(paper)["download"]


def test_a_corpus_the_pair_lacks_is_refused_before_anything_runs():
    cfg = load_config(None, ["--data.corpora=news_commentary_v9,giga_fren"])  # giga_fren is EN-FR's
    with pytest.raises(ConfigError, match=r"data\.corpora: no training corpus 'giga_fren' here; this language "
                                          r"pair has europarl_v7, commoncrawl, news_commentary_v9"):
        check_corpora(cfg)
    check_corpora(load_config(None, ["--data.tgt_lang=fr", "--data.corpora=news_commentary_v9,giga_fren"]))


def test_corpora_are_wmt14s_and_each_named_once():
    with pytest.raises(ConfigError, match=r"data\.corpora: chooses among WMT14's training corpora; "
                                          r"data\.source = 'multi30k'"):
        load_config(None, ["--data.source=multi30k", "--data.corpora=news_commentary_v9"])
    with pytest.raises(ConfigError, match=r"data\.corpora: names a corpus twice"):
        load_config(None, ["--data.corpora=commoncrawl,commoncrawl"])
