"""Reproduce Transformer base (Vaswani et al., 2017) on WMT14 EN-DE, as one cached DAG on Ray.

    python workflows/reproduce_base.py --config configs/local.toml [--section.key=value ...]
    ray job submit --address http://127.0.0.1:8265 --working-dir . -- \
        python workflows/reproduce_base.py --config configs/cluster.toml   # the head's dashboard (docs/cluster.md)

The other rows of Table 2 are one config away: configs/big.toml, configs/enfr-base.toml,
configs/enfr-big.toml; add ``--config configs/cluster-overlay.toml`` after any of them for the cluster.

Flags: --plan (print what would run and why), --only STAGE, --from STAGE, --to STAGE, --force STAGE,
--record FILE (``make run`` / ``make multi30k``: work/last-run.json, which ``make serve`` serves),
--print-config (the resolved config as TOML). ``transformer-repro run`` / ``plan`` (workflows/cli.py)
parse the same flags with this parser; ``--help`` lists every config key after them.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `python workflows/reproduce_base.py` puts workflows/ first, not the repo
    sys.path.insert(0, str(REPO))

from pipeline import run_record, storage  # noqa: E402
from pipeline.config import ConfigError, load_config  # noqa: E402
from pipeline.config.reference import help_text, to_toml  # noqa: E402
from pipeline.data.fetch import DataError  # noqa: E402
from pipeline.dag import ORDER  # noqa: E402
from pipeline.stage import NotImplementedStage  # noqa: E402
from pipeline.tracking import tracking_uri_for  # noqa: E402
from workflows import runner  # noqa: E402
from workflows.lock import WorkDirBusy, WorkDirLock  # noqa: E402
from workflows.preflight import preflight  # noqa: E402
from workflows.session import driver_session  # noqa: E402

log = logging.getLogger("reproduce_base")


def parse_args(argv: list[str], prog: str | None = None) -> tuple[argparse.Namespace, list[str]]:
    """The flags and the ``--section.key=value`` overrides; --help ends with every config key
    (`pipeline.config.reference.help_text`)."""
    # Every key's help is read from the schema's source (~50 ms): only when help is asked for.
    asks_help = any(a in ("-h", "--help") for a in argv)
    p = argparse.ArgumentParser(prog=prog, description=__doc__, epilog=help_text() if asks_help else None,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", action="append", default=None,
                   help="TOML file (configs/base.toml, configs/local.toml, ...); repeatable: later files "
                        "override earlier ones, e.g. --config configs/big.toml --config configs/cluster-overlay.toml")
    p.add_argument("--plan", action="store_true", help="print each stage as cached / to run and why, and the "
                   "train stage's bill (FLOPs per step, hours and GPU-hours); run nothing")
    p.add_argument("--mfu-from", default="", metavar="FILE",
                   help="the bill's MFU from a benchmarks/gpu_check.sh JSON (default: plan.mfu_from, else the "
                        "assumed plan.assumed_mfu)")
    p.add_argument("--only", choices=ORDER, help="run just this stage (its inputs must be cached)")
    p.add_argument("--from", dest="from_", choices=ORDER, help="rerun this stage and everything after it")
    p.add_argument("--to", choices=ORDER, help="stop after this stage (e.g. --to encode prepares the data only)")
    p.add_argument("--force", choices=ORDER, action="append", default=[],
                   help="rerun this stage (and what depends on it) even if cached; repeatable")
    p.add_argument("--record", default="", metavar="FILE",
                   help="when the run ends with a model (its average stage done), record its config in FILE "
                        "(pipeline/run_record.py), so that `serve run ... run_record=FILE` (make serve) serves it")
    p.add_argument("--print-config", action="store_true",
                   help="print the resolved config (defaults < --config files < overrides) as TOML; run nothing")
    args, rest = p.parse_known_args(argv)
    bad = [a for a in rest if not (a.startswith("--") and "=" in a and "." in a.split("=", 1)[0])]
    if bad:
        p.error(f"unrecognized arguments: {' '.join(bad)} (config overrides look like --section.key=value)")
    if args.only and (args.from_ or args.force):
        p.error("--only cannot be combined with --from/--force")
    return args, rest


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args, overrides = parse_args(sys.argv[1:] if argv is None else argv, prog)
    try:
        cfg = load_config(args.config, overrides)
        if args.print_config:  # before preflight: reads no work dir, starts nothing
            print(to_toml(cfg), end="", flush=True)
            return 0
        preflight(cfg, write=not args.plan, check_tracking=not args.plan)  # before the plan reads the work dir
        busy = WorkDirLock(cfg.run.work_dir).holder() if args.plan else None  # a run takes the lock below
        plans = runner.make_plan(cfg, only=args.only, from_=args.from_, force=tuple(args.force), to=args.to,
                                 busy=busy)
    except (ConfigError, runner.PlanError, ConnectionError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(runner.format_plan(plans), flush=True)
    if args.plan:
        from pipeline.plan.bill import num_parameters

        print(f"model: {num_parameters(cfg) / 1e6:.1f}M parameters at vocab.size {cfg.vocab.size}", flush=True)
        try:
            print("\n" + runner.format_bill(cfg, plans, args.mfu_from), flush=True)
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return 0
    if all(p.action != "run" for p in plans):
        log.info("every selected stage is cached: nothing to run")
    try:
        runs = {p.stage.name for p in plans if p.action == "run"}
        with driver_session(cfg, start_ray=bool(runs), runs=runs) as session:
            with session.parent_run({"config_file": ", ".join(args.config or []),
                                     "argv": " ".join(sys.argv[1:])}) as tracking:
                manifests = runner.execute(cfg, plans, tracking)
        if args.record and "average" in manifests:
            run_record.write(args.record, cfg, args.config or [], overrides,
                             tracking_uri_for(cfg) if cfg.tracking.enabled else "")
            log.info("recorded this run's model in %s: serve it with `make serve` (or serve run "
                     "pipeline.serve.app:build_app run_record=%s)", args.record, args.record)
        report = manifests["score"].outputs.get("report") if "score" in manifests else None
        if report:  # the one table a user looks for: ours next to the paper's
            print("\n" + storage.read_text(report), flush=True)
    except (ConfigError, WorkDirBusy, ConnectionError, NotImplementedStage, DataError) as e:
        print(f"error: {e}", file=sys.stderr)  # a download that failed names its URL: no traceback to read
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
