"""Reproduce Table 3 of Vaswani et al. (2017): the model variations, trained like base, side by side.

    python workflows/reproduce_table3.py --rows A,B                # rows A1-A4 and B1-B2 on configs/base.toml
    python workflows/reproduce_table3.py --rows base,C4,E --plan   # what would run, and each model's size
    python workflows/reproduce_table3.py --rows A --config configs/base.toml --config configs/cluster-overlay.toml
    python workflows/reproduce_table3.py --rows C --max-concurrent-rows 4 --config ... # 4 rows train at once
    python workflows/reproduce_table3.py --rows base,after2017 --config configs/multi30k-fast.toml  # on a laptop

Besides the paper's rows, ``after2017`` names the rows after 2017 (prenorm, rmsnorm, swiglu, rotary,
and all four: later), which the paper has no values for. Each row is ``configs/table3/<row>.toml``
applied on top of the recipe (``--config``, repeatable,
default configs/base.toml), then the ``--section.key=value`` overrides. All rows share one work
dir, so the data stages (download .. encode) run once, first; then each row's own chain (train ->
average -> export -> translate -> score) runs as its own branch, as many side by side as
``--max-concurrent-rows`` (default: as many as the Ray cluster holds, each row needing
``workers.num_workers`` workers; one at a time when the driver runs its own local Ray). A row
that fails does not stop the others: the table marks it failed with the reason, and rerunning
the same command continues only the unfinished rows (everything finished is cached).
As §6.2 does for Table 3, every row is scored on newstest2013 (``score.splits = ["dev"]``) with
beam search and no checkpoint averaging (``average.checkpoints = 1``). The table (Markdown, JSON)
and a figure (PNG: dev PPL and BLEU per row beside the paper's) are written to
``<work_dir>/table3/``, printed (the table) and logged to the sweep's MLflow run, in which each
row has its own nested run (tags ``table3_row``, ``table3_varies``) holding its stage runs.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
import tomllib
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `python workflows/reproduce_table3.py` puts workflows/ first
    sys.path.insert(0, str(REPO))

from pipeline import storage  # noqa: E402
from pipeline.config import Config, ConfigError, load_config  # noqa: E402
from pipeline.ray_env import ray_address  # noqa: E402
from workflows import runner, sweep  # noqa: E402
from workflows.lock import WorkDirBusy  # noqa: E402
from workflows.preflight import preflight  # noqa: E402
from workflows.session import DriverSession, driver_session  # noqa: E402
from workflows.table3 import ROWS, expand_rows, papers_task, render_table, write_figure  # noqa: E402

log = logging.getLogger("reproduce_table3")
TABLE3_DIR = REPO / "configs" / "table3"


def variant_config(row: str, configs: list[str], overrides: list[str]) -> Config:
    """The recipe, then ``configs/table3/<row>.toml``, then the command-line overrides."""
    return load_config([*configs, TABLE3_DIR / f"{row}.toml"], overrides)


def varies(row: str) -> str:
    """What the row's file changes in the recipe's model and training ("model.d_k=16")."""
    data = tomllib.loads((TABLE3_DIR / f"{row}.toml").read_text())
    items = [f"{section}.{k}={v}" for section in ("model", "train") for k, v in data.get(section, {}).items()]
    return ", ".join(items) or "nothing (the reference row)"


def row_tags(row: str) -> dict[str, str]:
    return {"workflow": "reproduce_table3", "table3_row": row, "table3_variation": ROWS[row][0],
            "table3_varies": varies(row)}


def row_result(row: str, cfg: Config, outcome: sweep.Outcome) -> dict[str, Any]:
    """The row's table entry: its numbers when it finished, else the stage and the reason it failed."""
    from pipeline.decoding.bleu import paper_metric
    from pipeline.decoding.dev_bleu_records import table3_dev_bleu
    from pipeline.plan.bill import num_parameters

    entry: dict[str, Any] = {"row": row, "params": num_parameters(cfg), "status": "done",
                             "started": _iso(outcome.started), "finished": _iso(outcome.finished),
                             "wall_s": round(outcome.finished - outcome.started, 1), "ran": outcome.ran}
    manifests = outcome.manifests
    if manifests is None:
        entry.update(status="failed", failed_stage=outcome.failed_stage, error=outcome.error, ppl_dev=None,
                     bleu_dev=None, train_steps=None)
        return entry
    key = paper_metric(cfg.data.tgt_lang, cfg.data.preprocess)
    scores = manifests["score"].outputs["scores"]
    dev = scores["dev"]
    entry.update(ppl_dev=manifests["train"].metrics.get("val/final_ppl"), bleu_dev=dev[key], bleu_metric=key,
                 bleu_sacre_dev=dev["bleu_sacre"], train_steps=manifests["train"].outputs["final_step"],
                 train_wall_s=manifests["train"].outputs.get("wall_s"),  # loop time, summed over attempts
                 **({"bleu_test": scores["test"][key]} if "test" in scores else {}),
                 train_key=manifests["train"].key,
                 # The row's own dev BLEU from training (its final checkpoint), when it was validated.
                 **table3_dev_bleu(manifests["train"].outputs, key))
    return entry


def _iso(epoch_s: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(epoch_s))


def publish(results: list[dict[str, Any]], cfg: Config, parent: Any) -> str:
    """Write table3.md, table3.json and table3.png to <work_dir>/table3/ and log them to the
    sweep's run (`parent`, a RunLogger); the Markdown."""
    table = render_table(results, cfg)
    out = storage.join(storage.absolute(cfg.run.work_dir), "table3")
    as_json = json.dumps(results, indent=2) + "\n"
    storage.write_text(storage.join(out, "table3.md"), table)
    storage.write_text(storage.join(out, "table3.json"), as_json)
    with tempfile.TemporaryDirectory() as tmp:
        png = Path(tmp) / "table3.png"
        write_figure(results, str(png), papers=papers_task(cfg))
        storage.upload(png, storage.join(out, "table3.png"))
        parent.log_artifact(str(png), "table3")
    parent.log_text(table, "table3/table3.md")
    parent.log_text(as_json, "table3/table3.json")
    return table


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", required=True, help="comma-separated rows or groups: base, A1..A4, B1, B2, "
                                                 "C1..C7, D1..D4, E, big; A, B, C, D = the whole group; "
                                                 "after2017 = prenorm, rmsnorm, swiglu, rotary, later (all four)")
    p.add_argument("--config", action="append", default=None,
                   help="the recipe the rows vary (default configs/base.toml); repeatable, later files win")
    p.add_argument("--plan", action="store_true", help="print each row's size and plan; run nothing")
    p.add_argument("--max-concurrent-rows", type=int, default=0, metavar="N",
                   help="rows that run side by side (default 0 = as many as the Ray cluster holds, each row "
                        "needing workers.num_workers workers; 1 when this driver starts its own local Ray)")
    args, rest = p.parse_known_args(argv)
    bad = [a for a in rest if not (a.startswith("--") and "=" in a and "." in a.split("=", 1)[0])]
    if bad:
        p.error(f"unrecognized arguments: {' '.join(bad)} (config overrides look like --section.key=value)")
    if args.max_concurrent_rows < 0:
        p.error(f"--max-concurrent-rows must be >= 0 (0 = as many as fit), got {args.max_concurrent_rows}")
    return args, rest


def _load(args: argparse.Namespace, overrides: list[str]) -> tuple[Config, dict[str, Config]]:
    """The recipe alone (the sweep's own MLflow run) and each row's config; all share one work dir."""
    configs = args.config or [str(REPO / "configs" / "base.toml")]
    rows = expand_rows(args.rows)
    cfgs = {row: variant_config(row, configs, overrides) for row in rows}
    work_dirs = {c.run.work_dir for c in cfgs.values()}
    if len(work_dirs) != 1:
        raise ConfigError(f"run.work_dir: the rows must share one work dir (their data stages are shared), "
                          f"got {sorted(work_dirs)}")
    return load_config(configs, overrides), cfgs


def print_plans(cfgs: dict[str, Config]) -> None:
    from pipeline.plan.bill import num_parameters

    for row, cfg in cfgs.items():
        paper = "not given" if ROWS[row][3] is None else f"{ROWS[row][3]}M"
        print(f"row {row} ({ROWS[row][0]}): {num_parameters(cfg) / 1e6:.1f}M parameters (paper: {paper})\n"
              f"{runner.format_plan(runner.make_plan(cfg))}\n", flush=True)


def run_sweep(session: DriverSession, recipe: Config, cfgs: dict[str, Config], max_concurrent: int,
              argv: list[str]) -> list[dict]:
    """In the driver's session (the work-dir lock, Ray up): the data stages once, then the rows side
    by side, under the sweep's MLflow run; the results."""
    first = next(iter(cfgs.values()))
    local = ray_address(first) == "local"  # this driver's own Ray
    n = max_concurrent or (1 if local else sweep.default_concurrency(list(cfgs.values())))
    rows = [sweep.Row(row, cfg, row_tags(row)) for row, cfg in cfgs.items()]
    with session.parent_run({"table3_rows": ",".join(cfgs), "max_concurrent_rows": str(n), "argv": " ".join(argv)},
                            cfg=recipe, tracking_tags={"workflow": "reproduce_table3"},
                            run_name=f"table3: {','.join(cfgs)}") as tracking:
        parent = tracking.parent
        sweep.run_data_stages(rows, tracking)
        outcomes = sweep.run_rows(rows, n, parent.run_id)
        results = [row_result(row, cfgs[row], outcomes[row]) for row in cfgs]
        failed = [r["row"] for r in results if r["status"] != "done"]
        parent.set_tags({"table3_failed_rows": ",".join(failed) or "none"})
        print("\n" + publish(results, first, parent), flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(threadName)s %(name)s: %(message)s")
    argv = sys.argv[1:] if argv is None else argv
    args, overrides = parse_args(argv)
    try:
        recipe, cfgs = _load(args, overrides)
        first = next(iter(cfgs.values()))
        preflight(first, write=not args.plan, check_tracking=not args.plan)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.plan:
        print_plans(cfgs)
        return 0
    try:
        with driver_session(first) as session:
            results = run_sweep(session, recipe, cfgs, args.max_concurrent_rows, argv)
    except (ConfigError, WorkDirBusy, ConnectionError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    failed = [f"{r['row']} (at {r['failed_stage']}: {r['error']})" for r in results if r["status"] != "done"]
    if failed:
        print(f"error: {len(failed)} row(s) failed: {'; '.join(failed)}; rerun the same command to continue "
              "them", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
