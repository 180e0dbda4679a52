"""workflows/reproduce_table3.py on a two-node Ray cluster: rows side by side, a failed row, a rerun,
one table.

A head and a worker node (2 CPUs each) on 127.0.0.1; rows B1 (d_k = 16 < d_v = 32 at this size) and
E (learned positions) of Table 3 on configs/local.toml at tiny sizes, on the synthetic mirror's text
(the point is the scheduling), with ``--max-concurrent-rows 2``: the data stages run once, first, and
are shared; each row's training takes one node's CPUs, so the two train stages run at the same time
(their MLflow runs' start/end times overlap). Row E's `average` stage is made to fail (in the driver process, below): B1 still
finishes, the table marks E failed with the reason, and the same command run again runs only E's
unfinished stages; then both rows are in one table beside the paper's numbers, and a third row
added afterwards plans only its own training and evaluation. (One row at a time, the default in
local mode: tests/unit/core/test_table3_sweep.py.)

The driver runs in a subprocess so that its Ray connection never mixes with a Ray that other
tests of the session started in the pytest process.
"""

from __future__ import annotations

import json
import re
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.test_end_to_end import TINY
from tests.support.procs import RayHead, stop
from workflows import reproduce_table3
from workflows.table3 import PAPER

# TINY at d_model 64 (2 heads: d / h = 32) so that B1's d_k = 16 differs from d_v; Table 3's rows
# score the dev set (their files set score.splits = ["dev"]).
SIZES = [a for a in TINY if not a.startswith(("--model.d_model", "--model.d_ff", "--score.max_sentences",
                                              "--train.max_steps"))]
SIZES += ["--model.d_model=64", "--model.d_ff=128", "--score.max_sentences=60", "--train.max_steps=16"]
# No dev BLEU during training (a Ray task per checkpoint): the table's BLEU is `score`'s, and dev BLEU
# while training is tests/integration/test_dev_bleu.py's (and test_end_to_end.py's).
SIZES += ["--dev_bleu.enabled=false"]

REPO = Path(__file__).resolve().parents[2]
DRIVER = r"""
import json, sys
from workflows import reproduce_table3
argv, fail_row = json.loads(sys.argv[1]), sys.argv[2]
if fail_row:
    import pipeline.evaluate.average as average
    real = average.run
    def failing(ctx):
        if ctx.cfg.run.name == f"table3-{fail_row}":
            raise RuntimeError(f"injected failure in row {fail_row}'s average stage")
        return real(ctx)
    average.run = failing
sys.exit(reproduce_table3.main(argv))
"""


def drive(argv: list[str], fail_row: str, log: Path) -> int:
    with open(log, "w") as f:
        return subprocess.run([sys.executable, "-c", DRIVER, json.dumps(argv), fail_row], cwd=REPO, stdout=f,
                              stderr=subprocess.STDOUT, timeout=900).returncode


@pytest.mark.slow
@pytest.mark.timeout(1200)  # two sweep drivers (the second reruns the failed row), each waited up to 900 s
def test_rows_run_side_by_side_and_a_failed_row_reruns_alone(tmp_path, synthetic_mirror, monkeypatch, capsys):
    from mlflow import MlflowClient

    monkeypatch.setenv("RAY_AUTH_MODE", "token")  # as cluster.yaml starts a cluster (and test_cluster_train.py)
    monkeypatch.setenv("RAY_AUTH_TOKEN", secrets.token_hex(32))  # a throwaway token, never ~/.ray/auth_token
    work = tmp_path / "work"
    head = RayHead(tmp_path, num_cpus=1)
    worker = head.add_worker(num_cpus=1)
    common = ["--config", "configs/local.toml", f"--run.work_dir={work}", f"--data.mirror={synthetic_mirror}",
              f"--run.ray_address={head.address}", "--workers.cpus_per_worker=1", *SIZES]
    argv = ["--rows", "B1,E", "--max-concurrent-rows", "2", *common]
    try:
        rc = drive(argv, "E", tmp_path / "driver-1.log")
        first = json.loads((work / "table3" / "table3.json").read_text())
        table = (work / "table3" / "table3.md").read_text()
        rc2 = drive(argv, "", tmp_path / "driver-2.log")
    finally:
        stop(worker, timeout_s=0)
        head.stop()
    log1 = (tmp_path / "driver-1.log").read_text()
    assert rc == 1, log1[-4000:]
    b1, e = first
    assert b1["status"] == "done" and b1["train_steps"] == 16 and 0.0 <= b1["bleu_dev"] <= 100.0
    assert set(b1["ran"]) == {"train", "average", "export", "translate", "score", "register"}
    assert e["status"] == "failed" and e["failed_stage"] == "average" and e["bleu_dev"] is None
    assert e["error"] == "RuntimeError: injected failure in row E's average stage"
    e_line = next(x for x in table.splitlines() if x.startswith("| E |"))
    assert "**failed** at average: RuntimeError: injected failure" in e_line
    assert "error: 1 row(s) failed: E (at average" in log1

    client = MlflowClient(f"sqlite:///{work}/mlflow.db")
    exp = client.get_experiment_by_name("transformer-wmt14-ende")
    sweeps = client.search_runs([exp.experiment_id], "attributes.run_name = 'table3: B1,E'",
                                order_by=["attributes.start_time ASC"])
    assert len(sweeps) == 2 and sweeps[0].data.tags["table3_failed_rows"] == "E"
    assert sweeps[1].data.tags["table3_failed_rows"] == "none"
    sweep = sweeps[0]
    artifacts = {a.path for a in client.list_artifacts(sweep.info.run_id, "table3")}
    assert artifacts == {"table3/table3.md", "table3/table3.json", "table3/table3.png"}
    rows = {r.data.tags["table3_row"]: r for r in
            client.search_runs([exp.experiment_id], f"tags.mlflow.parentRunId = '{sweep.info.run_id}'")
            if "stage" not in r.data.tags}  # the sweep's own children: the rows (and the data stages)
    assert set(rows) == {"B1", "E"}
    assert rows["B1"].info.status == "FINISHED" and rows["E"].info.status == "FAILED"
    assert rows["B1"].data.tags["table3_varies"] == "model.d_k=16"
    assert rows["E"].data.tags["table3_varies"] == "model.positional=learned"
    trains = {}
    for row, run in rows.items():
        (train,) = client.search_runs([exp.experiment_id], f"tags.mlflow.parentRunId = '{run.info.run_id}' "
                                                           "and tags.stage = 'train'")
        assert train.info.run_name == f"{row}: train" and train.data.tags["table3_row"] == row
        trains[row] = train.info
    # Side by side: each train run started before the other ended.
    assert max(t.start_time for t in trains.values()) < min(t.end_time for t in trains.values()), trains

    # The rerun: B1 is all cached, E continues after its finished training.
    log2 = (tmp_path / "driver-2.log").read_text()
    assert rc2 == 0, log2[-4000:]
    b1, e = json.loads((work / "table3" / "table3.json").read_text())
    assert b1["status"] == e["status"] == "done" and b1["ran"] == []
    assert e["ran"] == ["average", "export", "register", "score", "translate"]  # its training was done: cached
    assert e["ppl_dev"] > 1.0 and 0.0 <= e["bleu_dev"] <= 100.0

    # One table: the data stages ran once (one key each); each row trained its own model.
    for stage in ("download", "prepare", "vocab", "encode"):
        assert len(list((work / stage).glob("*/_manifest.json"))) == 1, stage
    assert b1["train_key"] != e["train_key"] and b1["train_steps"] == e["train_steps"] == 16
    # Marian cannot hold B1's d_k nor E's learned positions: export says so instead of writing folders.
    reasons = sorted(json.loads(m.read_text())["outputs"]["not_exported"] for m in (work / "export").glob("*/_manifest.json"))
    assert len(reasons) == 2 and "d_k/d_v" in reasons[0] and "learned" in reasons[1]
    for r in (b1, e):
        assert r["ppl_dev"] > 1.0 and 0.0 <= r["bleu_dev"] <= 100.0 and r["bleu_metric"] == "bleu_tok_cs"
    # E's learned table adds max_positions x d_model; B1's W_Q and W_K are h x d_k = 2 x 16 wide instead
    # of 2 x 32: 2 matrices x (64 x 32 weights + 32 biases) less in each of the 3 attention blocks.
    assert e["params"] - b1["params"] == 256 * 64 + 3 * 2 * (64 * 32 + 32)
    table = (work / "table3" / "table3.md").read_text()
    assert table in log2
    for row in ("B1", "E"):
        line = next(x for x in table.splitlines() if x.startswith(f"| {row} |"))
        assert f"| {PAPER[row][1]:.2f} |" in line and f"| {PAPER[row][2]:.1f} |" in line  # the paper's columns
        assert re.search(r"\| \d+\.\d min \| done \|$", line), line  # the training loop's time
    assert "Partial dev set" in table

    # Adding a row: only its training and evaluation are new (a plan starts no Ray).
    monkeypatch.chdir(REPO)
    assert reproduce_table3.main(["--rows", "B1,E,D3", "--plan", *common]) == 0
    plan = capsys.readouterr().out
    d3 = plan.split("row D3")[1]
    actions = {line.split()[0]: line.split()[2] for line in d3.splitlines()[1:] if len(line.split()) > 2
               and line.split()[0] in ("download", "prepare", "vocab", "encode", "train", "score")}
    assert actions == {"download": "cached", "prepare": "cached", "vocab": "cached", "encode": "cached",
                       "train": "run", "score": "run"}, d3
    assert "run " not in plan.split("row D3")[0].split("row E")[1]  # E is fully cached
