"""workflows/sweep.py and workflows/table3.py without Ray: how many rows fit, branches, threads,
a failing row, the table's failure marks and the figure."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import matplotlib.image
import pytest

from workflows import sweep
from workflows.reproduce_table3 import row_tags, variant_config, varies
from workflows.table3 import render_table, write_figure

REPO = Path(__file__).resolve().parents[3]
LOCAL = [str(REPO / "configs" / "local.toml")]


@pytest.mark.parametrize(("nodes", "workers", "need", "fits"), [
    ([{"CPU": 16, "GPU": 8}] * 8, 8, {"CPU": 1, "GPU": 1}, 8),  # the paper's 8 GPUs per row on 64 GPUs
    ([{"CPU": 16, "GPU": 8}] * 8, 2, {"CPU": 1, "GPU": 1}, 32),
    ([{"CPU": 4, "GPU": 8}] * 2, 8, {"CPU": 1, "GPU": 1}, 1),  # CPUs are scarcer: 4 workers a node
    ([{"CPU": 2}, {"CPU": 2}], 1, {"CPU": 2}, 2),
    ([{"CPU": 3}, {"CPU": 3}], 1, {"CPU": 2}, 2),  # a worker does not span nodes: 1 CPU idle on each
    ([{"CPU": 2}], 4, {"CPU": 2}, 1),  # not even one row fits: still 1 (Ray waits for resources)
    ([{"CPU": 8}], 1, {"CPU": 1, "GPU": 1}, 1),  # GPU rows on a CPU-only cluster
])
def test_rows_that_fit(nodes, workers, need, fits):
    assert sweep.rows_that_fit(nodes, workers, need) == fits


def test_rows_with_one_train_key_share_a_branch(tmp_path):
    work = [f"--run.work_dir={tmp_path}"]
    b1, e = variant_config("B1", LOCAL, work), variant_config("E", LOCAL, work)
    rows = [sweep.Row("B1", b1), sweep.Row("E", e), sweep.Row("B1-again", variant_config("B1", LOCAL, work))]
    assert [[r.name for r in g] for g in sweep.branches(rows)] == [["B1", "B1-again"], ["E"]]


def test_what_a_row_varies_is_read_from_its_file():
    assert varies("B1") == "model.d_k=16"
    assert varies("C4") == "model.d_model=256, model.d_k=32, model.d_v=32"
    assert varies("base") == "nothing (the reference row)"
    assert row_tags("E")["table3_variation"] == "positional embedding instead of sinusoids"


def _fake_rows(tmp_path, names):
    return [sweep.Row(n, variant_config(n, LOCAL, [f"--run.work_dir={tmp_path}", "--tracking.enabled=false"])) for n in names]


@pytest.mark.parametrize("max_concurrent", [1, 2])
def test_rows_run_in_threads_up_to_the_limit(tmp_path, monkeypatch, max_concurrent):
    spans: dict[str, tuple[float, float, str]] = {}

    def fake_execute(cfg, plans, tracking):
        t0 = time.monotonic()
        time.sleep(0.3)
        spans[tracking.label] = (t0, time.monotonic(), threading.current_thread().name)
        return {}

    monkeypatch.setattr(sweep.runner, "execute", fake_execute)
    out = sweep.run_rows(_fake_rows(tmp_path, ["B1", "E"]), max_concurrent, None)
    assert list(out) == ["B1", "E"] and all(o.error is None for o in out.values())
    (s1, e1, t1), (s2, e2, t2) = spans["B1"], spans["E"]
    overlap = min(e1, e2) - max(s1, s2)
    if max_concurrent == 2:
        assert overlap > 0.2 and t1 != t2
    else:
        assert overlap < 0


def test_a_failing_row_is_recorded_and_the_others_finish(tmp_path, monkeypatch):
    def fake_execute(cfg, plans, tracking):
        if tracking.label == "E":
            raise RuntimeError("out of memory on a worker")
        time.sleep(0.2)
        return {"score": "done"}

    monkeypatch.setattr(sweep.runner, "execute", fake_execute)
    out = sweep.run_rows(_fake_rows(tmp_path, ["E", "B1"]), 2, None)
    assert out["B1"].error is None and out["B1"].manifests == {"score": "done"}
    assert out["E"].manifests is None and out["E"].error == "RuntimeError: out of memory on a worker"
    assert out["E"].failed_stage == "download"  # an empty work dir: nothing before it finished


RESULTS = [
    {"row": "base", "params": 9.0e6, "status": "done", "ppl_dev": 120.5, "bleu_dev": 1.3, "train_steps": 16,
     "bleu_metric": "bleu_tok_cs"},
    {"row": "B1", "params": 8.5e6, "status": "done", "ppl_dev": 130.0, "bleu_dev": 0.9, "train_steps": 16,
     "bleu_metric": "bleu_tok_cs"},
    {"row": "E", "params": 9.1e6, "status": "failed", "failed_stage": "average",
     "error": "RuntimeError: boom | and more", "ppl_dev": None, "bleu_dev": None, "train_steps": None},
]


def test_the_table_marks_a_failed_row_with_its_reason():
    table = render_table(RESULTS, variant_config("base", LOCAL, []))
    lines = {line.split("|")[1].strip(): line for line in table.splitlines() if line.startswith("| ") and "---" not in line}
    assert lines["B1"].rstrip().endswith("| done |") and "| 130.00 | 5.16 | 0.9 | 25.1 |" in lines["B1"]
    assert "| E | positional embedding instead of sinusoids | - | - | 4.92 | - | 25.7 |" in lines["E"]
    assert "**failed** at average: RuntimeError: boom \\| and more |" in lines["E"]
    assert "Failed rows: E." in table


LATER_RESULTS = [
    {"row": "base", "params": 7.6e6, "status": "done", "ppl_dev": 6.81, "bleu_dev": 30.12, "bleu_test": 31.25,
     "train_steps": 900, "train_wall_s": 1260.0, "bleu_metric": "bleu"},
    {"row": "swiglu", "params": 8.8e6, "status": "done", "ppl_dev": 6.5, "bleu_dev": 31.0, "bleu_test": 32.5,
     "train_steps": 900, "train_wall_s": 1500.0, "bleu_metric": "bleu"},
]


def _rows(table: str) -> dict[str, list[str]]:
    return {cells[0]: cells for cells in ([c.strip() for c in line.strip("|").split("|")] for line in
                                          table.splitlines() if line.startswith("| ") and "---" not in line)}


def test_a_rows_entry_has_its_test_bleu_and_the_loops_time():
    """`row_result` on a finished row's manifests: the paper's metric on dev and test, and the train
    loop's time summed over attempts (the train stage's output), not the last attempt's stage wall."""
    from pipeline.stage import Manifest
    from workflows.reproduce_table3 import row_result

    cfg = variant_config("swiglu", [str(REPO / "configs" / "multi30k-fast.toml")], [])
    scores = {split: {"bleu_tok_lc": bleu, "bleu_sacre": bleu - 1} for split, bleu in (("dev", 29.7), ("test", 30.8))}
    train = Manifest(stage="train", key="t", dir="", outputs={"final_step": 600, "wall_s": 2204.5},
                     metrics={"val/final_ppl": 6.1}, extra={"wall_s": 900.0})
    outcome = sweep.Outcome(row="swiglu", started=0.0, finished=2400.0,
                            manifests={"train": train, "score": Manifest(stage="score", key="s", dir="",
                                                                         outputs={"scores": scores})})
    entry = row_result("swiglu", cfg, outcome)
    assert (entry["bleu_dev"], entry["bleu_test"], entry["bleu_metric"]) == (29.7, 30.8, "bleu_tok_lc")
    assert (entry["train_wall_s"], entry["train_steps"], entry["ppl_dev"], entry["wall_s"]) == (2204.5, 600, 6.1, 2400.0)
    dev_only = {"dev": scores["dev"]}
    outcome.manifests["score"] = Manifest(stage="score", key="s", dir="", outputs={"scores": dev_only})
    assert "bleu_test" not in row_result("swiglu", cfg, outcome)


def test_another_recipes_table_has_test_bleu_and_no_paper_columns():
    """On Multi30k the paper's newstest2013 values would compare nothing: not shown; test BLEU and
    the train stage's wall time are."""
    cfg = variant_config("base", [str(REPO / "configs" / "multi30k-fast.toml")], [])
    rows = _rows(render_table(LATER_RESULTS, cfg))
    assert rows["row"] == ["row", "variation", "steps", "PPL dev (ours)", "BLEU dev (ours)", "BLEU test (ours)",
                           "params x10^6 (ours)", "train wall", "status"]
    assert rows["swiglu"] == ["swiglu", "SwiGLU FFN (Shazeer, 2020)", "900", "6.50", "31.0", "32.50", "8.8",
                              "25.0 min", "done"]
    assert rows["base"][5:8] == ["31.25", "7.6", "21.0 min"]


def test_a_later_row_on_the_papers_task_has_no_paper_values():
    rows = _rows(render_table(LATER_RESULTS, variant_config("base", LOCAL, [])))
    assert rows["row"][3:6] == ["PPL dev (ours)", "PPL dev (paper)", "BLEU dev (ours)"]
    assert rows["swiglu"][4] == "-" and rows["swiglu"][6] == "-" and rows["swiglu"][9] == "-"
    assert rows["base"][4] == "4.92" and rows["base"][6] == "25.8"


def test_the_figure_is_a_png_of_the_rows(tmp_path):
    path = tmp_path / "t3.png"
    write_figure(RESULTS, str(path))
    img = matplotlib.image.imread(path)
    # figsize (max(6, 0.55 x 3 rows + 3), 6.2) inches at 110 dpi
    assert img.shape[:2] == (round(6.2 * 110), round(6.0 * 110))
    assert img[..., :3].std() > 0.05  # not blank


@pytest.mark.parametrize(("nodes", "overrides", "fits"), [
    ([{"CPU": 16, "GPU": 8}] * 4, ["--workers.use_gpu=true", "--workers.num_workers=8"], 4),
    ([{"CPU": 16, "GPU": 8}] * 4, ["--workers.use_gpu=true", "range"], 2),  # [4, 16]: counted at its max
    ([{"CPU": 2}, {"CPU": 2}], ["--workers.num_workers=1"], 2),  # CPU auto: a node's CPUs per worker
    ([{"CPU": 2}, {"CPU": 2}], ["--workers.num_workers=1", "--workers.cpus_per_worker=1"], 4),
])
def test_default_concurrency_reads_the_cluster(tmp_path, monkeypatch, nodes, overrides, fits):
    import ray

    recipe = list(LOCAL)
    if "range" in overrides:
        overrides = [o for o in overrides if o != "range"]
        (tmp_path / "range.toml").write_text("[workers]\nnum_workers = [4, 16]\n")
        recipe.append(str(tmp_path / "range.toml"))

    alive = [{"Alive": True, "Resources": n} for n in nodes] + [{"Alive": False, "Resources": {"CPU": 64}}]
    totals = {k: sum(n.get(k, 0) for n in nodes) for k in ("CPU", "GPU")}
    monkeypatch.setattr(ray, "nodes", lambda: alive)
    monkeypatch.setattr(ray, "cluster_resources", lambda: totals)
    cfgs = [variant_config(r, recipe, overrides) for r in ("B1", "E")]
    assert sweep.default_concurrency(cfgs) == fits
