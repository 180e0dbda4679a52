"""The plumbing tests' mirror (tests/support/synthetic_mirror.py): statmt.org's EN-DE layout, parallel
lines, the same bytes from the same seed, read by the download stage as the real mirror is."""

from __future__ import annotations

import tarfile
from pathlib import Path

from pipeline.data import download, sources
from pipeline.data.clean import file_lines
from pipeline.config import Config
from pipeline.stage import StageContext
from tests.support.synthetic_mirror import WORDS, write_mirror


def test_the_same_seed_writes_the_same_bytes_and_another_seed_other_text(tmp_path):
    a, b, c = (write_mirror(tmp_path / name, pairs_per_corpus=50, seed=seed) for name, seed in
               (("a", 0), ("b", 0), ("c", 1)))
    assert (a / "SHA256SUMS").read_text() == (b / "SHA256SUMS").read_text()
    assert (a / "SHA256SUMS").read_text() != (c / "SHA256SUMS").read_text()
    listed = {line.split()[1].removeprefix("./") for line in (a / "SHA256SUMS").read_text().splitlines()}
    assert listed == {x.relpath for x in sources.archives(sources.wmt14_en_de())}


def test_every_registry_member_is_there_with_parallel_lines(tmp_path):
    root = write_mirror(tmp_path / "m", pairs_per_corpus=40, dev_pairs=7, test_pairs=9)
    cfg = Config()
    cfg.data.mirror, cfg.run.work_dir = str(root), str(tmp_path / "work")
    out = download.run(StageContext(name="download", key="k", cfg=cfg, out_dir=str(tmp_path / "out"), inputs={}))
    files = out.outputs
    for entry, n in [*((t, 40) for t in files["train"]), (files["dev"], 7), (files["test"], 9)]:
        en, de = ([b.decode() for b in file_lines(entry[side])] for side in ("src", "tgt"))
        assert len(en) == len(de) == n, entry
        # "German" is English word by word through the dictionary (names kept): the same word count
        assert all(len(e.split()) == len(d.split()) for e, d in zip(en, de)), entry
    vocab_de = {d for words in WORDS.values() for _, d in words}
    assert any(w in vocab_de for w in Path(files["train"][0]["tgt"]).read_text().split())
    with tarfile.open(root / "wmt14" / "test-full.tgz") as tar:
        assert all(n.startswith("./test-full/") for n in tar.getnames())  # the real archive's ./ prefix
