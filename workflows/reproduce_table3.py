"""Reproduce Table 3 of Vaswani et al. (2017): the model variations, trained like base, side by side.

    python workflows/reproduce_table3.py --rows A,B                # rows A1-A4 and B1-B2 on configs/base.toml
    python workflows/reproduce_table3.py --rows base,C4,E --plan   # what would run, and each model's size
    python workflows/reproduce_table3.py --rows A --config configs/base.toml --config configs/cluster-overlay.toml

Each row is ``configs/table3/<row>.toml`` applied on top of the recipe (``--config``, repeatable,
default configs/base.toml), then the ``--section.key=value`` overrides. All rows share one work
dir, so the data stages (download .. encode) are cached once; each row's training is its own
cached stage (its key holds the row's model/train values), so adding a row reruns only that row.
As §6.2 does for Table 3, every row is scored on newstest2013 (``eval.splits = ["dev"]``) with
beam search and no checkpoint averaging (``eval.average_last = 1``). The table (Markdown and
JSON) is written to ``<work_dir>/table3/`` and printed: ours beside the paper's columns.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `python workflows/reproduce_table3.py` puts workflows/ first
    sys.path.insert(0, str(REPO))

from pipeline import storage  # noqa: E402
from pipeline.config import Config, ConfigError, load_config  # noqa: E402
from workflows import runner  # noqa: E402
from workflows.lock import WorkDirBusy, WorkDirLock  # noqa: E402

log = logging.getLogger("reproduce_table3")
TABLE3_DIR = REPO / "configs" / "table3"

# Table 3 of the paper (EN-DE, newstest2013): row -> (what varies, PPL (dev), BLEU (dev), params x 10^6).
# PPL is per word-piece; the paper gives parameter counts for some rows only.
PAPER: dict[str, tuple[str, float, float, float | None]] = {
    "base": ("base", 4.92, 25.8, 65),
    "A1": ("h=1, d_k=d_v=512", 5.29, 24.9, None), "A2": ("h=4, d_k=d_v=128", 5.00, 25.5, None),
    "A3": ("h=16, d_k=d_v=32", 4.91, 25.8, None), "A4": ("h=32, d_k=d_v=16", 5.01, 25.4, None),
    "B1": ("d_k=16", 5.16, 25.1, 58), "B2": ("d_k=32", 5.01, 25.4, 60),
    "C1": ("N=2", 6.11, 23.7, 36), "C2": ("N=4", 5.19, 25.3, 50), "C3": ("N=8", 4.88, 25.5, 80),
    "C4": ("d_model=256, d_k=d_v=32", 5.75, 24.5, 28), "C5": ("d_model=1024, d_k=d_v=128", 4.66, 26.0, 168),
    "C6": ("d_ff=1024", 5.12, 25.4, 53), "C7": ("d_ff=4096", 4.75, 26.2, 90),
    "D1": ("P_drop=0.0", 5.77, 24.6, None), "D2": ("P_drop=0.2", 4.95, 25.5, None),
    "D3": ("eps_ls=0.0", 4.67, 25.3, None), "D4": ("eps_ls=0.2", 5.47, 25.7, None),
    "E": ("positional embedding instead of sinusoids", 4.92, 25.7, None),
    "big": ("big", 4.33, 26.4, 213),
}


def expand_rows(spec: str) -> list[str]:
    """``"A,B,big"`` -> ``["A1", .., "A4", "B1", "B2", "big"]``: a letter is its whole group."""
    rows: list[str] = []
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        group = [r for r in PAPER if r[0] == item and r[1:].isdigit()] if len(item) == 1 else []
        if item in PAPER:
            group = [item]
        if not group:
            raise ConfigError(f"--rows: unknown row '{item}' (rows: {', '.join(PAPER)}; or a group A, B, C, D)")
        rows += [r for r in group if r not in rows]
    return rows


def variant_config(row: str, configs: list[str], overrides: list[str]) -> Config:
    """The recipe, then ``configs/table3/<row>.toml``, then the command-line overrides."""
    return load_config([*configs, TABLE3_DIR / f"{row}.toml"], overrides)


def run_variant(row: str, cfg: Config) -> dict[str, Any]:
    """Plan (now: earlier rows' stages are cached by then) and run one row; its table entry."""
    from pipeline.evaluate.bleu import paper_metric
    from pipeline.evaluate.dev_bleu import table3_dev_bleu
    from pipeline.tracking import Tracking
    from pipeline.train.size import num_parameters

    plans = runner.make_plan(cfg)
    log.info("table3 row %s:\n%s", row, runner.format_plan(plans))
    tracking = Tracking(cfg)
    with tracking.parent_run({"workflow": "reproduce_table3", "table3_row": row}):
        manifests = runner.execute(cfg, plans, tracking)
    key = paper_metric(cfg.data.tgt_lang)
    dev = manifests["score"].outputs["scores"]["dev"]
    return {"row": row, "params": num_parameters(cfg), "ppl_dev": manifests["train"].metrics.get("val/final_ppl"),
            "bleu_dev": dev[key], "bleu_metric": key, "bleu_sacre_dev": dev["bleu_sacre"],
            "train_steps": manifests["train"].outputs["final_step"], "train_key": manifests["train"].key,
            "ran": sorted(p.stage.name for p in plans if p.action == "run"),
            # The row's own dev BLEU from training (its final checkpoint), when it was validated.
            **table3_dev_bleu(manifests["train"].outputs, key)}


def _num(x: Any, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def render_table(results: list[dict[str, Any]], cfg: Config) -> str:
    """Markdown: each row's PPL / BLEU / params (ours) beside the paper's."""
    out = ["# Table 3 (Vaswani et al., 2017): model variations, newstest2013", "",
           "| row | variation | steps | PPL dev (ours) | PPL dev (paper) | BLEU dev (ours) | BLEU dev (paper) "
           "| params x10^6 (ours) | params x10^6 (paper) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        what, ppl, bleu, params = PAPER[r["row"]]
        out.append(f"| {r['row']} | {what} | {r['train_steps']} | {_num(r['ppl_dev'], '.2f')} | {ppl:.2f} "
                   f"| {_num(r['bleu_dev'], '.1f')} | {bleu:.1f} | {r['params'] / 1e6:.1f} | {_num(params, '.0f')} |")
    metric = results[0]["bleu_metric"] if results else "bleu_tok_cs"
    out += ["", f"Ours: dev = newstest2013, beam {cfg.eval.beam_size}, alpha {cfg.eval.alpha}, no checkpoint "
            f"averaging (§6.2); BLEU = `{metric}` (the tokenized BLEU of Table 2); PPL = exp(NLL per target "
            "piece) of the last step's model on dev (train stage's `val/final_ppl`). Our pieces are a "
            f"{cfg.vocab.size}-piece SentencePiece BPE model, not the paper's word-pieces, so PPL values compare "
            "between rows, not exactly with the paper's.", ""]
    if cfg.eval.max_sentences:
        out.insert(0, f"> **Partial dev set**: only the first {cfg.eval.max_sentences} sentences were decoded "
                      "(`eval.max_sentences`): not comparable with the paper.\n")
    return "\n".join(out)


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", required=True, help="comma-separated rows or groups: base, A1..A4, B1, B2, "
                                                 "C1..C7, D1..D4, E, big; A, B, C, D = the whole group")
    p.add_argument("--config", action="append", default=None,
                   help="the recipe the rows vary (default configs/base.toml); repeatable, later files win")
    p.add_argument("--plan", action="store_true", help="print each row's size and plan; run nothing")
    args, rest = p.parse_known_args(argv)
    bad = [a for a in rest if not (a.startswith("--") and "=" in a and "." in a.split("=", 1)[0])]
    if bad:
        p.error(f"unrecognized arguments: {' '.join(bad)} (config overrides look like --section.key=value)")
    return args, rest


def main(argv: list[str] | None = None) -> int:
    from pipeline.ray_env import ensure_ray
    from pipeline.train.size import num_parameters
    from workflows.reproduce_base import preflight

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    configs = args.config or [str(REPO / "configs" / "base.toml")]
    try:
        rows = expand_rows(args.rows)
        cfgs = {row: variant_config(row, configs, overrides) for row in rows}
        work_dirs = {c.run.work_dir for c in cfgs.values()}
        if len(work_dirs) != 1:
            raise ConfigError(f"run.work_dir: the rows must share one work dir (their data stages are shared), "
                              f"got {sorted(work_dirs)}")
        first = cfgs[rows[0]]
        preflight(first, write=not args.plan, check_tracking=not args.plan)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.plan:
        for row, cfg in cfgs.items():
            paper = "not given" if PAPER[row][3] is None else f"{PAPER[row][3]}M"
            print(f"row {row} ({PAPER[row][0]}): {num_parameters(cfg) / 1e6:.1f}M parameters (paper: {paper})\n"
                  f"{runner.format_plan(runner.make_plan(cfg))}\n", flush=True)
        return 0
    started_ray = False
    try:
        with WorkDirLock(first.run.work_dir):
            started_ray = ensure_ray(first)
            from pipeline.tracking import Tracking

            Tracking(first).end_dead_runs()  # under the lock: RUNNING runs of this work dir are a dead driver's
            results = [run_variant(row, cfg) for row, cfg in cfgs.items()]
        table = render_table(results, first)
        out = storage.join(storage.absolute(first.run.work_dir), "table3")
        storage.write_text(storage.join(out, "table3.md"), table)
        storage.write_text(storage.join(out, "table3.json"), json.dumps(results, indent=2) + "\n")
        print("\n" + table, flush=True)
    except (ConfigError, WorkDirBusy, ConnectionError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if started_ray:
            import ray

            ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
