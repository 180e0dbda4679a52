"""WMT14 EN-FR on the offline mirror: the data stages into shards, checked against the mirror's files.

The four data stages run (tiny sizes, as tests/integration/test_end_to_end.py does EN-DE); the
prepare and encode manifests they leave are then checked against the mirror's own files, and a rerun
is cached. Past `encode` nothing depends on the language pair but score's report and tokenized BLEU:
the whole DAG is guarded by test_end_to_end.py (EN-DE), EN-FR's report row (38.1, no compound split)
by tests/unit/evaluate/test_score.py::test_en_fr_report_has_its_own_row_and_no_compound_split.
"""

from __future__ import annotations

import gzip
import json
import re
import tarfile
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.integration.test_end_to_end import TINY, plan_actions, run
from workflows import reproduce_base

# The bound on each test (pytest-timeout): the EN-FR data stages in local mode (~30 s).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

# Lines before cleaning in the mirror's fr-en members (statmt-mirror/README.md), capped by TINY's
# --data.max_pairs_per_corpus=1500: europarl 3000, commoncrawl 1500, un 10068, nc 5000, giga 1000.
NUM_READ = {"europarl_v7": 1500, "commoncrawl": 1500, "un": 1500, "news_commentary_v9": 1500, "giga_fren": 1000}


def _manifest(work: Path, stage: str) -> dict:
    (path,) = work.glob(f"{stage}/*/_manifest.json")
    return json.loads(path.read_text())


def _column(split_dir: str, name: str) -> list:
    files = sorted(Path(split_dir).glob("part-*.parquet"))
    rows = [r for f in files for r in pq.read_table(f, columns=["idx", name]).to_pylist()]
    return [r[name] for r in sorted(rows, key=lambda r: r["idx"])]


def _member(mirror: Path, archive: str, member: str) -> list[str]:
    with tarfile.open(mirror / archive) as tar:
        return tar.extractfile(member).read().decode("utf-8").splitlines()


def test_en_fr_data_stages(tmp_path, mirror_dir, capsys, monkeypatch):
    monkeypatch.chdir(reproduce_base.REPO)
    work = tmp_path / "work"
    args = [f"--run.work_dir={work}", f"--data.mirror={mirror_dir}", "--data.tgt_lang=fr",
            "--tracking.experiment=transformer-wmt14-enfr", *TINY, "--to", "encode"]
    rc, out = run(args, capsys)
    assert rc == 0, out
    assert {s: a for s, a in plan_actions(out).items() if a == "run"} == \
        {s: "run" for s in ("download", "prepare", "vocab", "encode")}, out

    prep = _manifest(work, "prepare")["outputs"]
    assert set(prep["dropped_by_corpus"]) == set(NUM_READ) | {"newstest2013"}
    splits = prep["splits"]
    assert splits["train"]["num_read"] == sum(NUM_READ.values())
    assert splits["train"]["num_rows"] + sum(prep["dropped_by_split"]["train"].values()) == sum(NUM_READ.values())
    assert splits["dev"]["num_read"] == 3000
    assert splits["test"]["num_rows"] == 3003  # the full newstest2014 fr-en, never filtered
    # The dev set is dev.tgz's newstest2013 en/fr, line for line (less what cleaning counted).
    dev_fr = _member(mirror_dir, "wmt14/dev.tgz", "./dev/newstest2013.fr")
    kept_dev = _column(splits["dev"]["dir"], "tgt")
    assert set(kept_dev) <= set(dev_fr) and len(kept_dev) == splits["dev"]["num_rows"]
    # The test set is sacrebleu's en-fr pair of files (source English, reference French), read
    # here with a plain regex over the SGML instead of sacrebleu's converter; as `sacrebleu -t
    # wmt14/full` does, whitespace runs (the French side's no-break spaces too) become one space.
    for side, member in (("src", "src.en"), ("tgt", "ref.fr")):
        sgm = _member(mirror_dir, "wmt14/test-full.tgz", f"./test-full/newstest2014-fren-{member}.sgm")
        segs = [re.sub(r"\s+", " ", m.group(1).strip()) for line in sgm
                if (m := re.search(r"<seg[^>]*>(.*)</seg>", line))]
        assert _column(splits["test"]["dir"], side) == segs
    # Giga's members are gzip files in a plain tar: every kept giga pair is its line, decompressed
    # (and whitespace-trimmed, as cleaning does for train and dev).
    with tarfile.open(mirror_dir / "wmt10/training-giga-fren.tar") as tar:
        giga = {lang: gzip.decompress(tar.extractfile(f"giga-fren.release2.fixed.{lang}.gz").read())
                .decode("utf-8").split("\n") for lang in ("en", "fr")}
    files = sorted(Path(splits["train"]["dir"]).glob("part-*.parquet"))
    rows = [r for f in files for r in pq.read_table(f).to_pylist() if r["corpus"] == "giga_fren"]
    assert len(rows) > 900
    assert all((r["src"], r["tgt"]) == (giga["en"][r["line"] - 1].strip(), giga["fr"][r["line"] - 1].strip())
               for r in rows)
    enc = _manifest(work, "encode")["outputs"]["splits"]
    assert {s: enc[s]["num_rows"] for s in ("train", "dev", "test")} == \
        {s: splits[s]["num_rows"] for s in ("train", "dev", "test")}

    rc, out = run(args, capsys)  # all cached
    assert rc == 0 and {s for s, a in plan_actions(out).items() if a == "cached"} == \
        {"download", "prepare", "vocab", "encode"}, out
