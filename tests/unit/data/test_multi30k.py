"""Multi30k task 1 as a data source and its preprocessing: the registry's URLs and checksums, the
download stage from the offline mirror and over HTTP (the real URL layout, resumable), a checksum
mismatch, and ``lowercase_moses`` against the dataset's own tokenized files and sacremoses."""

from __future__ import annotations

import gzip
import hashlib
import http.server
import shutil
from pathlib import Path

import pyarrow as pa
import pytest

from pipeline.config import Config, ConfigError, load_config
from pipeline.data import download, sources
from pipeline.data.fetch import ChecksumError
from pipeline.data.preprocess import preprocess_table
from pipeline.decoding.text import TextFormat, lowercase_moses
from pipeline.stage import StageContext
from tests.support.http import serve

REPO = Path(__file__).resolve().parents[3]
LINES = {"train": 29000, "dev": 1014, "test": 1000}


def _cfg(mirror: str, work: Path) -> Config:
    cfg = Config()
    cfg.data.source, cfg.data.mirror = "multi30k", mirror
    cfg.run.work_dir = str(work)
    return cfg.validate()


def _run(cfg: Config, out: Path) -> dict:
    return download.run(StageContext(name="download", key="k", cfg=cfg, out_dir=str(out), inputs={})).outputs


def test_registry_urls_are_pinned_and_checksummed(multi30k_dir):
    files = sources.multi30k("en", "de")
    assert [(f.name, f.split) for f in files] == [("multi30k_train", "train"), ("multi30k_val", "dev"),
                                                  ("multi30k_test_2016_flickr", "test")]
    for pair in files:
        for lang, f in pair.files.items():
            assert f.url.startswith(f"https://github.com/multi30k/dataset/raw/{sources.MULTI30K_COMMIT}/data/task1/raw/")
            assert f.relpath.startswith("data/task1/raw/") and f.relpath.endswith(f".{lang}.gz")
            # the registry's sha256 is the real file's (the mirror is byte-identical, PROVENANCE.md)
            assert hashlib.sha256((multi30k_dir / f.relpath).read_bytes()).hexdigest() == f.sha256
    assert [p.files["de"].relpath for p in sources.multi30k("de", "en")] == \
        [p.files["de"].relpath for p in files]
    with pytest.raises(ValueError, match="Multi30k task 1 here is en-de or de-en, got en-fr"):
        sources.multi30k("en", "fr")


def test_download_stage_from_the_mirror(multi30k_dir, tmp_path):
    out = _run(_cfg(str(multi30k_dir), tmp_path / "work"), tmp_path / "out")
    assert [e["corpus"] for e in out["train"]] == ["multi30k_train"]
    for split in ("train", "dev", "test"):
        entry = out["train"][0] if split == "train" else out[split]
        src = Path(entry["src"]).read_text(encoding="utf-8").splitlines()
        tgt = Path(entry["tgt"]).read_text(encoding="utf-8").splitlines()
        assert len(src) == len(tgt) == LINES[split]
    test_de = gzip.open(multi30k_dir / "data/task1/raw/test_2016_flickr.de.gz", "rt", encoding="utf-8").read()
    assert Path(out["test"]["tgt"]).read_text(encoding="utf-8") == test_de
    assert len(out["files"]) == 6 and all(len(f["sha256"]) == 64 for f in out["files"])


def test_download_stage_over_http_with_the_real_layout(multi30k_dir, tmp_path):
    """The mirror as a web server with the repository's paths: what the real URLs look like."""
    seen = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *a, **kw):
            super().__init__(*a, directory=str(multi30k_dir), **kw)

        def log_message(self, *args):
            seen.append(self.path)

    with serve(Handler) as url:
        out = _run(_cfg(url, tmp_path / "work"), tmp_path / "out")
        assert sorted(seen) == sorted(f"/{f.relpath}" for p in sources.multi30k("en", "de") for f in p.files.values())
        seen.clear()
        _run(_cfg(url, tmp_path / "work"), tmp_path / "out2")  # verified downloads in the cache are reused
        assert seen == []
    assert len(Path(out["dev"]["src"]).read_text(encoding="utf-8").splitlines()) == LINES["dev"]


def test_a_tampered_mirror_file_fails_its_checksum(multi30k_dir, tmp_path):
    mirror = tmp_path / "mirror"
    shutil.copytree(multi30k_dir / "data", mirror / "data")
    (mirror / "data/task1/raw/val.de.gz").chmod(0o644)
    (mirror / "data/task1/raw/val.de.gz").write_bytes(gzip.compress(b"tampered\n"))
    with pytest.raises(ChecksumError, match=r"val\.de\.gz .*expected sha256 f0cba2f9"):
        _run(_cfg(str(mirror), tmp_path / "work"), tmp_path / "out")


def test_config_names_the_allowed_values():
    cfg = Config()
    cfg.data.preprocess = "lowercase"
    with pytest.raises(ConfigError, match="data.preprocess"):
        cfg.validate()
    cfg = Config()
    cfg.data.source = "multi31k"
    with pytest.raises(ConfigError, match="data.source.*multi30k"):
        cfg.validate()


@pytest.mark.parametrize("name,sizes", [("multi30k-tiny.toml", (128, 256, 4, 4, 4, 0.3)),
                                        ("multi30k-fast.toml", (256, 1024, 4, 3, 3, 0.1))])
def test_shipped_multi30k_configs_load(name, sizes):
    cfg = load_config(REPO / "configs" / name)
    assert (cfg.data.source, cfg.data.preprocess) == ("multi30k", "lowercase_moses")
    m = cfg.model
    assert (m.d_model, m.d_ff, m.n_heads, m.n_encoder_layers, m.n_decoder_layers, m.dropout) == sizes


def test_lowercase_moses_equals_the_dataset_own_tokenized_test_files(multi30k_dir):
    """The dataset's tok/ files were made by Moses' lowercase.perl | normalize-punctuation.perl |
    tokenizer.perl: an independent reference. Both test_2016_flickr sides match line for line."""
    for lang in ("en", "de"):
        raw = gzip.open(multi30k_dir / f"data/task1/raw/test_2016_flickr.{lang}.gz", "rt", encoding="utf-8")
        ref = (multi30k_dir / f"data/task1/tok/test_2016_flickr.lc.norm.tok.{lang}").read_text(encoding="utf-8")
        ours = [lowercase_moses(line, lang) for line in raw.read().splitlines()]
        assert ours == ref.splitlines()


def test_lowercase_moses_on_val_differs_only_where_noted(multi30k_dir):
    """val.de: one line of 1014 differs (a period inside closing quotes; the Moses version the dataset
    used normalized it differently from sacremoses') - the README states it."""
    raw = gzip.open(multi30k_dir / "data/task1/raw/val.de.gz", "rt", encoding="utf-8").read().splitlines()
    ref = (multi30k_dir / "data/task1/tok/val.lc.norm.tok.de").read_text(encoding="utf-8").splitlines()
    diff = [i for i, (r, t) in enumerate(zip(raw, ref)) if lowercase_moses(r, "de") != t]
    assert len(diff) == 1 and "&quot;" in ref[diff[0]]


def test_lowercase_moses_is_sacremoses_run_directly():
    from sacremoses import MosesPunctNormalizer, MosesTokenizer

    lines = ["Ein Mann mit einem orangefarbenen Hut, der etwas anstarrt.", "It's a “nice” day -- isn't it?",
             "Zwei Männer & eine Frau (30 Jahre) stehen am Strand."]
    for lang in ("en", "de"):
        want = [MosesTokenizer(lang=lang).tokenize(MosesPunctNormalizer(lang=lang).normalize(line.lower()),
                                                   escape=True, return_str=True) for line in lines]
        assert [lowercase_moses(line, lang) for line in lines] == want
    assert lowercase_moses("It's a DOG.", "en") == "it &apos;s a dog ."


def test_preprocess_table_rewrites_both_sides_only():
    table = pa.table({"corpus": ["c", "c"], "line": [1, 2], "src": ["A Dog.", "Hi!"], "tgt": ["Ein Hund.", "Hallo!"]})
    out = preprocess_table(table, "lowercase_moses", "en", "de")
    assert out.column("src").to_pylist() == ["a dog .", "hi !"]
    assert out.column("tgt").to_pylist() == ["ein hund .", "hallo !"]
    assert out.column("line").to_pylist() == [1, 2] and out.schema == table.schema
    assert preprocess_table(table, "none", "en", "de") is table


def test_text_format_preprocesses_user_sentences_and_detokenizes_the_output():
    """What the translate CLI and the server do with a user's text for a Multi30k model, against
    sacremoses run directly; a model of plain text gets the text unchanged."""
    from sacremoses import MosesDetokenizer

    t = TextFormat("lowercase_moses", "en", "de")
    assert t.sources(["It's a DOG.", "Two  men, \"tired\"."]) == ["it &apos;s a dog .", "two men , &quot; tired . &quot;"]  # en: the period moves inside
    out = "ein mann &apos;s hut , &quot; rot &quot; ."
    assert t.output(out) == MosesDetokenizer(lang="de").detokenize(out.split()) == 'ein mann \'s hut, "rot".'
    assert TextFormat().sources(["It's"]) == ["It's"] and TextFormat().output("a &apos; .") == "a &apos; ."
    with pytest.raises(ValueError, match="preprocess='bpe'"):
        TextFormat("bpe")
