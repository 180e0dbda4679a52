"""Dev BLEU against wall-clock time for one workflow run, from its MLflow store (README, "Reproduced here").

    python benchmarks/dev_bleu_curve.py --tracking-uri sqlite:///work/multi30k/mlflow.db \
        --experiment transformer-multi30k-ende --run-name transformer-multi30k-fast \
        --out docs/img/multi30k-dev-bleu.png

Finds the newest parent run of that name, its nested train run, and plots every dev BLEU metric the
run logged per checkpoint (``dev/bleu_*``) against minutes since the parent run started (so the
data stages count), with the test scores of the averaged model (``test/*``) as points at the time
the score stage ended, and an optional published number as a line.
"""

from __future__ import annotations

import argparse
from pathlib import Path


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
    t0 = parent.info.start_time
    fig, ax = plt.subplots(figsize=(7, 4))
    for name in (f"dev/{args.metric}", "dev/bleu_sacre"):
        hist = sorted(client.get_metric_history(train.info.run_id, name), key=lambda m: m.step)
        if hist:
            ax.plot([(m.timestamp - t0) / 60e3 for m in hist], [m.value for m in hist], marker=".", label=name)
    end_min = ((parent.info.end_time or train.info.end_time or t0) - t0) / 60e3
    test = {k: v for k, v in parent.data.metrics.items() if k.startswith("test/")}
    for key, marker in ((f"test/{args.metric}", "*"), ("test/bleu_sacre", "x")):
        if key in test:
            ax.plot([end_min], [test[key]], marker=marker, markersize=12, linestyle="none",
                    label=f"{key} (averaged model, end of run) = {test[key]:.2f}")
    if args.published:
        ax.axhline(args.published, color="grey", linestyle="--", label=f"published test {args.metric} {args.published}")
    ax.set_xlabel("wall-clock minutes since the run started (data stages included)")
    ax.set_ylabel("BLEU")
    ax.set_title(f"{args.run_name}: dev BLEU per checkpoint")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}: run {parent.info.run_id}, {end_min:.1f} min, test {test}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
