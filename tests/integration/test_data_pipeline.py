"""download -> prepare -> vocab -> encode on the offline mirror served over HTTP, with a local Ray."""

from __future__ import annotations

import functools
import hashlib
import http.server
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.support.http import serve
from pipeline.data import download, encode
from pipeline.data import prepare, vocab
from pipeline.config import Config
from pipeline.data.fetch import DataError
from pipeline.stage import Manifest, StageContext

# The bound on each test (pytest-timeout): a local Ray may start here first.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def mirror_url(mirror_dir):
    with serve(functools.partial(_QuietHandler, directory=str(mirror_dir))) as url:
        yield url + "/"


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def _run(module, name: str, cfg: Config, work: Path, key: str = "k", **inputs: Manifest) -> Manifest:
    out = work / name / key
    result = module.run(StageContext(name=name, key=key, cfg=cfg, out_dir=str(out), inputs=inputs))
    return Manifest(stage=name, key=key, dir=str(out), outputs=result.outputs, metrics=result.metrics)


def _read_split(d: str) -> pa.Table:
    files = sorted(Path(d).glob("part-*.parquet"))
    return pa.concat_tables([pq.read_table(f) for f in files]).sort_by("idx")


def _digests(d: str) -> dict[str, str]:
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(Path(d).rglob("*"))
            if p.is_file()}


def test_data_stages_end_to_end(mirror_url, wmt14_dir, ray_local, tmp_path):
    cfg = Config()
    cfg.data.mirror = mirror_url
    cfg.data.num_shards = 2
    cfg.vocab.size = 1000
    cfg.run.work_dir = str(tmp_path)

    dl = _run(download, "download", cfg, tmp_path)
    assert dl.metrics["download/files"] == 10
    assert any((tmp_path / "_cache" / "download").rglob("test-full.tgz"))  # fetched over HTTP

    prep = _run(prepare, "prepare", cfg, tmp_path, download=dl)
    splits, dropped = prep.outputs["splits"], prep.outputs["dropped_by_split"]
    assert splits["train"]["num_read"] == 30_100
    assert splits["train"]["num_rows"] + sum(dropped["train"].values()) == 30_100
    assert splits["dev"]["num_read"] == 3000
    assert splits["dev"]["num_rows"] + sum(dropped["dev"].values()) == 3000
    assert splits["test"]["num_rows"] == 3003  # never filtered
    by_corpus = prep.outputs["dropped_by_corpus"]
    for rule, n in prep.outputs["dropped"].items():
        assert n == sum(c[rule] for c in by_corpus.values())
    test = _read_split(splits["test"]["dir"])
    assert test.column("idx").to_pylist() == list(range(3003))
    assert test.column("src").to_pylist() == (wmt14_dir / "newstest2014.en").read_text().splitlines()
    assert test.column("tgt").to_pylist() == (wmt14_dir / "newstest2014.de").read_text().splitlines()
    assert not list(Path(prep.dir).rglob("_staging"))

    voc = _run(vocab, "vocab", cfg, tmp_path, prepare=prep)
    assert voc.outputs["vocab_size"] == 1000
    assert {k: voc.outputs[k] for k in ("pad_id", "unk_id", "bos_id", "eos_id")} == \
        {"pad_id": 0, "unk_id": 1, "bos_id": 2, "eos_id": 3}

    enc1 = _run(encode, "encode", cfg, tmp_path, "k1", prepare=prep, vocab=voc)
    enc2 = _run(encode, "encode", cfg, tmp_path, "k2", prepare=prep, vocab=voc)
    assert _digests(enc1.dir) == _digests(enc2.dir)  # byte-identical shards
    assert len(_digests(enc1.dir)) == 6
    for split in ("train", "dev", "test"):
        assert enc1.outputs["splits"][split]["num_rows"] == splits[split]["num_rows"]
    enc_test = _read_split(enc1.outputs["splits"]["test"]["dir"])
    assert enc_test.schema.field("src_ids").type == pa.list_(pa.int32())
    assert enc_test.column("src").to_pylist() == test.column("src").to_pylist()
    ids = enc_test.column("src_ids").to_pylist()
    assert [len(x) for x in ids] == enc_test.column("src_len").to_pylist()
    assert not {0, 2, 3} & {i for x in ids for i in x}  # pieces only: no pad/bos/eos
    assert set(_read_split(enc1.outputs["splits"]["train"]["dir"]).column_names) == \
        {"idx", "src_ids", "tgt_ids", "src_len", "tgt_len"}
    assert enc1.outputs["splits"]["test"]["num_src_tokens"] == sum(enc_test.column("src_len").to_pylist())

    # Dedup drops exactly the repeated pairs an independent set() finds among the kept ones.
    cfg.data.dedup = True
    dedup = _run(prepare, "prepare", cfg, tmp_path, "dedup", download=dl)
    train = _read_split(splits["train"]["dir"])
    unique = len(set(zip(train.column("src").to_pylist(), train.column("tgt").to_pylist())))
    assert dedup.outputs["splits"]["train"]["num_rows"] == unique
    assert dedup.outputs["dropped"]["duplicate"] == train.num_rows - unique


def test_misaligned_custom_corpus_fails_through_ray(ray_local, tmp_path):
    (tmp_path / "a.en").write_text("one\ntwo\nthree\n")
    (tmp_path / "a.de").write_text("eins\nzwei\n")
    (tmp_path / "t.en").write_text("x\n")
    (tmp_path / "t.de").write_text("y\n")
    cfg = Config()
    cfg.data.source = "custom"
    cfg.data.train_src, cfg.data.train_tgt = [str(tmp_path / "a.en")], [str(tmp_path / "a.de")]
    cfg.data.dev_src = cfg.data.test_src = str(tmp_path / "t.en")
    cfg.data.dev_tgt = cfg.data.test_tgt = str(tmp_path / "t.de")
    cfg.run.work_dir = str(tmp_path)
    dl = _run(download, "download", cfg, tmp_path)
    with pytest.raises(DataError, match=r"misaligned corpus: .*train0\.src has 3 lines but .*train0\.tgt has 2"):
        _run(prepare, "prepare", cfg, tmp_path, download=dl)


@pytest.mark.parametrize("dedup", [False, True])
def test_large_corpora_in_parallel_segments_give_the_same_shards(mirror_dir, ray_local, tmp_path, monkeypatch,
                                                                 dedup):
    """A corpus cut into segments (forced here: every train corpus, 3000 lines each) yields the
    byte-identical shards and the same counts as one task per corpus, with dedup on or off."""
    cfg = Config()
    cfg.data.mirror, cfg.data.num_shards, cfg.data.dedup = str(mirror_dir), 3, dedup
    cfg.run.work_dir = str(tmp_path)
    dl = _run(download, "download", cfg, tmp_path)
    whole = _run(prepare, "prepare", cfg, tmp_path, "whole", download=dl)
    parts: list[int] = []
    combine = prepare.combine
    monkeypatch.setattr(prepare, "combine", lambda p, n=None: parts.append(len(p)) or combine(p, n))
    monkeypatch.setattr(prepare, "SEGMENT_MIN_BYTES", 0)
    monkeypatch.setattr(prepare, "SEGMENT_LINES", 3000)
    cut = _run(prepare, "prepare", cfg, tmp_path, "cut", download=dl)
    assert parts == [1, 4, 7, 1, 1]  # europarl 100 lines, commoncrawl 10k, news commentary 20k; dev, test
    for split in ("train", "dev", "test"):
        assert _digests(whole.outputs["splits"][split]["dir"]) == _digests(cut.outputs["splits"][split]["dir"])
    strip = lambda o: {k: v for k, v in o.items() if k != "splits"}  # noqa: E731
    assert strip(cut.outputs) == strip(whole.outputs)
    assert (cut.outputs["dropped"]["duplicate"] > 0) == dedup
