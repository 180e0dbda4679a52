"""A run's record: the config a run trained with, written so that its model can be found later
without repeating its command line. ``workflows/reproduce_base.py --record FILE`` writes it when the
run ends with a model (its ``average`` stage done); ``make run`` and ``make multi30k`` record in
``work/last-run.json``, and ``make serve`` serves the model it names (``pipeline.models.find_model``,
``run_record=``).

The record holds the run's resolved config (every value, the work dir made absolute) beside the
config files and overrides it was given. The model is found by that config's cache keys; read
back from the files and overrides instead, a config file edited since, or a relative path (the
work dir) read from another folder, would name other keys and so no model. The files and
overrides say which run it was (the page and ``GET /health`` show them).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Sequence

from pipeline import storage
from pipeline.config import Config, ConfigError, from_dict

FORMAT = "transformer-repro run record 1"  # what a reader accepts; a change of layout changes it


class NoRunRecord(ValueError):
    """No record where one was named, or a file that is not one: says which and what to do."""


@dataclass(kw_only=True)
class RunRecord:
    config_files: list[str]  # as the run was given them
    overrides: list[str]  # its --section.key=value overrides
    config: Config  # the resolved config it ran with (run.work_dir absolute)
    finished: str  # local time the run ended
    tracking_uri: str = ""  # the MLflow store it tracked to ("": not recorded, or tracking off)

    @property
    def command(self) -> str:
        """The run's config files and overrides, as one line (``configs/local.toml --data.mirror=...``)."""
        return " ".join([*self.config_files, *self.overrides])


def write(path: str, cfg: Config, config_files: Sequence[str], overrides: Sequence[str],
          tracking_uri: str = "") -> None:
    """Record that ``cfg`` (loaded from ``config_files`` and ``overrides``) trained a model, tracked
    to ``tracking_uri`` (what ``make ui`` opens)."""
    resolved = cfg.to_dict()
    resolved["run"]["work_dir"] = storage.absolute(cfg.run.work_dir)
    storage.write_json(path, {"format": FORMAT, "config_files": list(config_files), "overrides": list(overrides),
                              "config": resolved, "finished": time.strftime("%Y-%m-%dT%H:%M:%S"),
                              "tracking_uri": tracking_uri})


def read(path: str) -> RunRecord:
    """The record at ``path``; ``NoRunRecord`` when there is none or it is not a record."""
    try:
        data: Any = storage.read_json(path)
    except FileNotFoundError:
        raise NoRunRecord(f"{path}: no run recorded here yet (a run writes it when it ends with a trained "
                          "model: `make run` and `make multi30k` do); train one first, or name a model "
                          "another way (config=..., model=models:/..., model_dir=...)") from None
    except (OSError, ValueError) as e:
        raise NoRunRecord(f"{path}: not a run record ({e})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        got = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise NoRunRecord(f"{path}: not a run record of this version (format {got!r}, expected {FORMAT!r}); "
                          "rerun the workflow to record it again")
    try:
        cfg = from_dict(data["config"])
    except (ConfigError, KeyError, TypeError) as e:
        raise NoRunRecord(f"{path}: its config no longer loads ({e}); rerun the workflow to record it again") from None
    return RunRecord(config_files=list(data.get("config_files", [])), overrides=list(data.get("overrides", [])),
                     config=cfg,
                     finished=str(data.get("finished", "?")), tracking_uri=str(data.get("tracking_uri", "")))


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m pipeline.run_record FILE --tracking-uri``: the MLflow store the recorded run tracked
    to, on stdout (``make ui`` opens it); exit 2 naming what to do when there is none."""
    import argparse
    import sys

    ap = argparse.ArgumentParser(prog="python -m pipeline.run_record", description=main.__doc__)
    ap.add_argument("record", help="a run record (make run / make multi30k: work/last-run.json)")
    ap.add_argument("--tracking-uri", action="store_true", required=True, help="print the run's MLflow store")
    args = ap.parse_args(argv)
    try:
        record = read(args.record)
    except NoRunRecord as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not record.tracking_uri:
        print(f"error: {args.record}: the run of {record.command} recorded no MLflow store (tracking off, or a "
              "record written before stores were recorded); rerun it, or open the store with mlflow ui "
              "--backend-store-uri", file=sys.stderr)
        return 2
    print(record.tracking_uri)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
