"""``transformer-repro``: the project's commands under one name (pyproject.toml's [project.scripts]).

    transformer-repro run --config configs/local.toml [--section.key=value ...]   # the DAG (make run)
    transformer-repro plan --config configs/base.toml       # what would run and why, and the bill (run --plan)
    transformer-repro run --config configs/local.toml --print-config                # the resolved config
    transformer-repro serve [--record work/last-run.json] [key=value ...]         # its model on Ray Serve
    transformer-repro translate --config configs/local.toml < input.en             # the translate CLI
    transformer-repro table3 --rows A,B --plan                                     # Table 3's rows

Each subcommand hands its arguments to the entry point that owns them, so no flag is defined
twice: ``run`` and ``plan`` are ``workflows/reproduce_base.py`` (the script ``ray job submit``
runs; its parser, and ``--help`` listing every config key), ``serve`` is Ray Serve's ``serve run
pipeline.serve.app:build_app`` (as ``make serve``), ``translate`` is
``pipeline/decoding/translate_cli.py`` and ``table3`` is ``workflows/reproduce_table3.py``. Each
is imported only when its subcommand runs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable

PROG = "transformer-repro"
# Where `make run` / `make multi30k` record the run whose model `make serve` serves (Makefile's RUN_RECORD)
DEFAULT_RECORD = "work/last-run.json"
# The ServeSettings arguments that name a model themselves (pipeline/serve/app.py): with one, serve
# adds no run record
SERVE_MODEL_ARGS = ("run_record", "config", "model", "model_dir", "ct2_model")


def run(argv: list[str]) -> int:
    """The whole DAG, or the stages the flags select (reproduce_base.py)."""
    from workflows import reproduce_base

    return reproduce_base.main(argv, prog=f"{PROG} run")


def plan(argv: list[str]) -> int:
    """run --plan: each stage as cached / to run and why, and the train stage's bill; runs nothing."""
    from workflows import reproduce_base

    return reproduce_base.main(["--plan", *argv], prog=f"{PROG} plan")


def serve_args(argv: list[str]) -> list[str]:
    """``serve run``'s arguments for ``serve [--record FILE] [key=value ...]``: the app, then the run
    record (unless a key=value names the model), then the rest as given. A missing record is a
    SystemExit naming it and how to make one, as ``make serve`` says."""
    p = argparse.ArgumentParser(prog=f"{PROG} serve", description=serve.__doc__,
                                epilog="key=value: the app's arguments (pipeline/serve/app.py, ServeSettings: "
                                       "backend=ctranslate2, beam_size=5, num_replicas=2, model=models:/..., ...) "
                                       "and `serve run`'s own options (--address, ...)")
    p.add_argument("--record", default=DEFAULT_RECORD, metavar="FILE",
                   help=f"the run record whose model to serve (run --record FILE; make run: {DEFAULT_RECORD})")
    args, rest = p.parse_known_args(argv)
    named = any(a.split("=", 1)[0] in SERVE_MODEL_ARGS for a in rest if "=" in a and not a.startswith("-"))
    if named:
        return ["run", "pipeline.serve.app:build_app", *rest]
    if not Path(args.record).is_file():
        p.exit(2, f"{PROG} serve: no trained model yet ({args.record} is written when `{PROG} run --record "
                  f"{args.record}` (make run, make multi30k) ends with one): run that first, or name a model "
                  "(model=models:/..., config=FILE, model_dir=DIR spm=FILE)\n")
    return ["run", "pipeline.serve.app:build_app", f"run_record={args.record}", *rest]


def serve(argv: list[str]) -> int:
    """A run's model on Ray Serve until Ctrl-C (make serve): the page at http://127.0.0.1:8000/."""
    return serve_cli(serve_args(argv))


def serve_cli(args: list[str]) -> int:
    """Ray Serve's own ``serve`` command with `args`, in this process."""
    from ray.serve.scripts import cli

    return cli.main(args=args, prog_name="serve")


def translate(argv: list[str]) -> int:
    """Translate stdin (one English sentence per line) to German (pipeline/decoding/translate_cli.py)."""
    from pipeline.decoding import translate_cli

    _as_prog(f"{PROG} translate", translate_cli.main, argv)
    return 0


def table3(argv: list[str]) -> int:
    """Table 3's model variations, trained like base, side by side (workflows/reproduce_table3.py)."""
    from workflows import reproduce_table3

    return _as_prog(f"{PROG} table3", reproduce_table3.main, argv)


def _as_prog(prog: str, main: Callable[[list[str]], Any], argv: list[str]) -> Any:
    """`main(argv)` with `prog` as sys.argv[0], the name argparse gives its usage and errors when
    a parser names none (translate_cli's and reproduce_table3's do not)."""
    saved, sys.argv[0] = sys.argv[0], prog
    try:
        return main(argv)
    finally:
        sys.argv[0] = saved


COMMANDS: dict[str, Callable[[list[str]], int]] = {
    "run": run, "plan": plan, "serve": serve, "translate": translate, "table3": table3}


def parser() -> argparse.ArgumentParser:
    """The top level: the subcommands and what each is (its own --help has its flags)."""
    p = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=f"`{PROG} COMMAND --help` lists a command's flags (run and plan: every "
                                       "config key too).")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, fn in COMMANDS.items():
        sub.add_parser(name, help=(fn.__doc__ or "").split("\n", 1)[0], add_help=False)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        parser().parse_args(argv)  # --help prints the commands; anything else is a usage error (exit 2)
        return 2
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
