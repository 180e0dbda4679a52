"""workflows/reproduce_table3.py: two tiny variants end to end in local mode, one table.

Rows B1 (d_k = 16 < d_v = 32 at this size) and E (learned positions) on configs/local.toml with
tiny sizes, one row at a time (the default when the driver runs its own local Ray): the data
stages run once, first, and are shared, each row trains its own model, both are
scored on newstest2013 and written to one table beside the paper's numbers. A third row added
afterwards plans only its own training and evaluation.
"""

from __future__ import annotations

import json

import pytest

from tests.integration.test_end_to_end import TINY
from workflows import reproduce_table3
from workflows.reproduce_table3 import PAPER

pytestmark = pytest.mark.slow

# TINY at d_model 64 (2 heads: d / h = 32) so that B1's d_k = 16 differs from d_v; Table 3's rows
# score the dev set (their files set eval.splits = ["dev"]).
SIZES = [a for a in TINY if not a.startswith(("--model.d_model", "--model.d_ff", "--eval.max_sentences",
                                              "--train.max_steps"))]
SIZES += ["--model.d_model=64", "--model.d_ff=128", "--eval.max_sentences=60", "--train.max_steps=16"]


def test_two_rows_share_data_and_make_one_table(tmp_path, mirror_dir, capsys, monkeypatch):
    monkeypatch.chdir(reproduce_table3.REPO)
    work = tmp_path / "work"
    args = ["--config", "configs/local.toml", f"--run.work_dir={work}", f"--data.mirror={mirror_dir}", *SIZES]
    rc = reproduce_table3.main(["--rows", "B1,E", *args])
    out = capsys.readouterr().out
    assert rc == 0, out

    results = json.loads((work / "table3" / "table3.json").read_text())
    assert [r["row"] for r in results] == ["B1", "E"]
    b1, e = results
    # The data stages ran once, before the rows (one key each); each row ran its own chain.
    for stage in ("download", "prepare", "vocab", "encode"):
        assert len(list((work / stage).glob("*/_manifest.json"))) == 1, stage
    assert set(b1["ran"]) == set(e["ran"]) == {"train", "average", "export", "translate", "score",
                                                  "register"}
    assert b1["train_key"] != e["train_key"] and b1["train_steps"] == e["train_steps"] == 16
    # Marian cannot hold B1's d_k nor E's learned positions: export says so instead of writing folders.
    reasons = sorted(json.loads(m.read_text())["outputs"]["not_exported"] for m in (work / "export").glob("*/_manifest.json"))
    assert len(reasons) == 2 and "d_k/d_v" in reasons[0] and "learned" in reasons[1]
    for r in results:
        assert r["ppl_dev"] > 1.0 and 0.0 <= r["bleu_dev"] <= 100.0 and r["bleu_metric"] == "bleu_tok_cs"
    # E's learned table adds max_positions x d_model; B1's W_Q and W_K are h x d_k = 2 x 16 wide instead
    # of 2 x 32: 2 matrices x (64 x 32 weights + 32 biases) less in each of the 3 attention blocks.
    assert e["params"] - b1["params"] == 256 * 64 + 3 * 2 * (64 * 32 + 32)

    table = (work / "table3" / "table3.md").read_text()
    assert table in out
    for row in ("B1", "E"):
        line = next(x for x in table.splitlines() if x.startswith(f"| {row} |"))
        assert f"| {PAPER[row][1]:.2f} |" in line and f"| {PAPER[row][2]:.1f} |" in line  # the paper's columns
    assert "Partial dev set" in table

    # Adding a row: only its training and evaluation are new.
    rc = reproduce_table3.main(["--rows", "B1,E,D3", "--plan", *args])
    plan = capsys.readouterr().out
    assert rc == 0, plan
    d3 = plan.split("row D3")[1]
    actions = {line.split()[0]: line.split()[2] for line in d3.splitlines()[1:] if len(line.split()) > 2
               and line.split()[0] in ("download", "prepare", "vocab", "encode", "train", "score")}
    assert actions == {"download": "cached", "prepare": "cached", "vocab": "cached", "encode": "cached",
                       "train": "run", "score": "run"}, d3
    assert "run " not in plan.split("row D3")[0].split("row E")[1]  # E is fully cached
