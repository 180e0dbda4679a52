"""Dev BLEU against wall-clock time for one workflow run, from its MLflow store (README, "Reproduced here").

    python benchmarks/dev_bleu_curve.py --tracking-uri sqlite:///work/multi30k/mlflow.db \
        --experiment transformer-multi30k-ende --run-name transformer-multi30k-fast \
        --out docs/img/multi30k-dev-bleu.png

Finds the newest parent run of that name, its nested train run, and plots every dev BLEU metric the
run logged per checkpoint (``dev/bleu_*``) against the minutes the workflow ran (so the data stages
count), with the test scores of the averaged model (``test/*``) as points at the time the score
stage ended, and an optional published number as a line.

A train stage that was stopped and resumed keeps one MLflow run across the invocations that ran
it (tags ``parent_run.1``, ``parent_run.2``, ...). Its x axis is then the time those invocations
ran, summed: the hours between a stop and its resume, when nothing ran, are left out
(`active_minutes`).
"""

from __future__ import annotations

import argparse
from pathlib import Path


def active_minutes(t_ms: int, spans: list[tuple[int, int | None]]) -> float:
    """Minutes of `spans` (start, end) in ms, sorted by start, that lie before `t_ms`: the time
    the workflow ran up to `t_ms`, not counting the gaps between one invocation's end and the next
    one's start. An open span (end None: the invocation still ran, or its driver died without
    ending it) counts up to `t_ms` or to the next span's start."""
    total = 0
    for i, (start, end) in enumerate(spans):
        if t_ms <= start:
            break
        stop = end if end is not None else (spans[i + 1][0] if i + 1 < len(spans) else t_ms)
        total += min(t_ms, stop) - start
    return total / 60e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tracking-uri", required=True)
    ap.add_argument("--experiment", required=True)
    ap.add_argument("--run-name", required=True)
    ap.add_argument("--metric", default="bleu_tok_lc", help="the BLEU to draw (dev/<metric>, test/<metric>)")
    ap.add_argument("--published", type=float, default=41.02, help="a published test number to draw (0 = none)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from mlflow import MlflowClient

    client = MlflowClient(args.tracking_uri)
    exp = client.get_experiment_by_name(args.experiment)
    parents = client.search_runs([exp.experiment_id], f"attributes.run_name = '{args.run_name}'",
                                 order_by=["attributes.start_time DESC"])
    # The newest invocation that trained (a rerun of later stages has a cached train run).
    for parent in (p for p in parents if "mlflow.parentRunId" not in p.data.tags):
        children = client.search_runs([exp.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
        train = next((c for c in children if c.data.tags.get("stage") == "train"), None)
        if train is not None and train.data.tags.get("cached") != "true":
            break
    else:
        raise SystemExit(f"no run named {args.run_name} trained in {args.tracking_uri}")
    # Every invocation that ran this train run (one unless it was stopped and resumed), then this one.
    ids = [v for k, v in sorted(train.data.tags.items()) if k.startswith("parent_run.")]
    invocations = sorted({run.info.run_id: run for run in [*(client.get_run(i) for i in ids), parent]}.values(),
                         key=lambda r: r.info.start_time)
    spans = [(r.info.start_time, r.info.end_time) for r in invocations]
    fig, ax = plt.subplots(figsize=(7, 4))
    for name in (f"dev/{args.metric}", "dev/bleu_sacre"):
        hist = sorted(client.get_metric_history(train.info.run_id, name), key=lambda m: m.step)
        if hist:
            ax.plot([active_minutes(m.timestamp, spans) for m in hist], [m.value for m in hist], marker=".",
                    label=name)
    end_min = active_minutes(parent.info.end_time or train.info.end_time or parent.info.start_time, spans)
    test = {k: v for k, v in parent.data.metrics.items() if k.startswith("test/")}
    for key, marker in ((f"test/{args.metric}", "*"), ("test/bleu_sacre", "x")):
        if key in test:
            ax.plot([end_min], [test[key]], marker=marker, markersize=12, linestyle="none",
                    label=f"{key} (averaged model, end of run) = {test[key]:.2f}")
    if args.published:
        ax.axhline(args.published, color="grey", linestyle="--", label=f"published test {args.metric} {args.published}")
    resumed = f"; {len(spans)} invocations, gaps left out" if len(spans) > 1 else ""
    ax.set_xlabel(f"wall-clock minutes the workflow ran (data stages included{resumed})", fontsize=9)
    ax.set_ylabel("BLEU")
    ax.set_title(f"{args.run_name}: dev BLEU per checkpoint")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}: run {parent.info.run_id} ({len(spans)} invocation(s)), {end_min:.1f} min, test {test}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
