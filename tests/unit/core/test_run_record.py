"""``pipeline.run_record``: the record a run leaves (``reproduce_base.py --record``, ``make run``)
names its model for ``find_model(run_record=...)`` (``make serve``) with none of the run's
overrides repeated, from any folder, even after the config file changed.

The work dirs are written by the real runner (tests/support/fake_run.py), at the keys the run's own
config gives; the lookup without the record (the config file alone) is the reference that fails.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pipeline import run_record
from pipeline.config import load_config
from pipeline.models import ModelNotFound, find_model
from tests.support.fake_run import fake_run

ROOT = Path(__file__).resolve().parents[3]
LOCAL = str(ROOT / "configs" / "local.toml")
OUTPUTS = {"vocab": {"model": "/run/spm.model"},
           "average": {"model": "/run/avg/model.pt", "model_config": {"vocab_size": 100, "d_model": 16}}}


def _train(config: str, overrides: list[str], record: Path) -> None:
    """What ``reproduce_base.py --config CONFIG --record RECORD OVERRIDES`` leaves: the stages up to
    average finished, and the record of the config it ran with."""
    cfg = load_config(config, overrides)
    fake_run(cfg, OUTPUTS, to="average")
    run_record.write(str(record), cfg, [config], overrides)


def test_the_record_names_the_model_without_the_runs_overrides(tmp_path, monkeypatch):
    (tmp_path / "repo").mkdir()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "repo")  # a relative work dir, as configs/local.toml's
    overrides = ["--run.work_dir=work/local", "--data.mirror=../mirror", "--model.d_ff=96"]
    _train(LOCAL, overrides, tmp_path / "last-run.json")
    with pytest.raises(ModelNotFound, match="stage 'download' has not finished"):  # the mirror is in its key
        find_model(config=[LOCAL], overrides=["--run.work_dir=work/local"])
    monkeypatch.chdir(tmp_path / "elsewhere")  # `serve run` started from another folder
    files = find_model(run_record=str(tmp_path / "last-run.json"))
    assert (files.model, files.spm) == ("/run/avg/model.pt", "/run/spm.model")
    assert files.origin.startswith(f"the run of {LOCAL} --run.work_dir=work/local --data.mirror=../mirror "
                                   f"--model.d_ff=96 (recorded in {tmp_path / 'last-run.json'})")


def test_the_record_outlives_an_edit_of_the_config_file(tmp_path):
    config = tmp_path / "mine.toml"
    shutil.copy(LOCAL, config)
    overrides = [f"--run.work_dir={tmp_path / 'work'}"]
    _train(str(config), overrides, tmp_path / "last-run.json")
    assert find_model(config=[str(config)], overrides=overrides).model == "/run/avg/model.pt"
    text = config.read_text(encoding="utf-8")
    assert "\nd_ff = 512\n" in text
    config.write_text(text.replace("\nd_ff = 512\n", "\nd_ff = 1024\n"), encoding="utf-8")  # edited since the run
    with pytest.raises(ModelNotFound, match="stage 'train' has not finished"):  # the file names another model now
        find_model(config=[str(config)], overrides=overrides)
    assert find_model(run_record=str(tmp_path / "last-run.json")).model == "/run/avg/model.pt"


def test_work_dir_says_where_the_recorded_work_dir_is_now(tmp_path):
    _train(LOCAL, [f"--run.work_dir={tmp_path / 'work'}"], tmp_path / "last-run.json")
    shutil.move(tmp_path / "work", tmp_path / "moved")
    with pytest.raises(ModelNotFound, match="stage 'download' has not finished"):
        find_model(run_record=str(tmp_path / "last-run.json"))
    files = find_model(run_record=str(tmp_path / "last-run.json"), work_dir=str(tmp_path / "moved"))
    assert files.model == "/run/avg/model.pt"


def test_no_record_says_what_to_run_first(tmp_path):
    with pytest.raises(ModelNotFound, match=r"no run recorded here yet .*`make run` and `make multi30k`"):
        find_model(run_record=str(tmp_path / "last-run.json"))


@pytest.mark.parametrize("text, words", [
    ("{not json", "not a run record"),
    (json.dumps({"config": {}}), "not a run record of this version"),
    (json.dumps([1, 2]), "not a run record of this version (format 'list'"),
    (json.dumps({"format": run_record.FORMAT, "config": {"model": {"d_fff": 1}}}), "its config no longer loads"),
])
def test_a_file_that_is_not_a_record_is_named(tmp_path, text, words):
    (tmp_path / "r.json").write_text(text, encoding="utf-8")
    with pytest.raises(ModelNotFound, match=f"^{tmp_path / 'r.json'}: " + words.replace("(", r"\(")):
        find_model(run_record=str(tmp_path / "r.json"))


def test_one_model_per_call(tmp_path):
    with pytest.raises(ModelNotFound, match="name one model: .* \\(got config, run_record"):
        find_model(config=[LOCAL], run_record=str(tmp_path / "r.json"))


def test_the_record_names_the_store_the_run_tracked_to_for_make_ui(tmp_path, capsys):
    """`make ui` opens the store of the recorded run (`python -m pipeline.run_record FILE --tracking-uri`),
    wherever the run's work dir was; a missing record or one without a store exits 2 naming it."""
    cfg = load_config(LOCAL, [f"--run.work_dir={tmp_path / 'multi30k'}"])
    record = tmp_path / "last-run.json"
    store = f"sqlite:///{tmp_path / 'multi30k'}/mlflow.db"
    run_record.write(str(record), cfg, [LOCAL], [], tracking_uri=store)
    assert run_record.main([str(record), "--tracking-uri"]) == 0
    assert capsys.readouterr().out.strip() == store
    assert run_record.read(str(record)).tracking_uri == store

    assert run_record.main([str(tmp_path / "none.json"), "--tracking-uri"]) == 2
    err = capsys.readouterr().err
    assert "no run recorded here yet" in err and "make run" in err
    run_record.write(str(record), cfg, [LOCAL], [])  # tracking off: no store
    assert run_record.main([str(record), "--tracking-uri"]) == 2
    assert "recorded no MLflow store" in capsys.readouterr().err


def test_make_ui_opens_the_recorded_store(tmp_path):
    """The Makefile's `ui` target hands `mlflow ui` the recorded store: run with a venv whose `mlflow`
    prints its arguments (and whose python is this one), so nothing is served."""
    import os
    import subprocess
    import sys

    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    for name, body in (("python", f'exec {sys.executable} "$@"'), ("mlflow", 'echo "mlflow $*"')):
        (venv / "bin" / name).write_text(f"#!/bin/sh\n{body}\n")
        (venv / "bin" / name).chmod(0o755)
    (venv / ".installed").touch()  # newer than pyproject.toml: `install` has nothing to do
    cfg = load_config(LOCAL, [f"--run.work_dir={tmp_path / 'w'}"])
    record = tmp_path / "last-run.json"
    store = f"sqlite:///{tmp_path}/w/mlflow.db"
    run_record.write(str(record), cfg, [LOCAL], [], tracking_uri=store)

    def make_ui(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["make", "-s", "-o", "install", "ui", f"VENV={venv}", *args], capture_output=True,
                              text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})

    out = make_ui(f"RUN_RECORD={record}")
    assert out.returncode == 0 and f"mlflow ui --backend-store-uri {store} --host 127.0.0.1" in out.stdout, out
    server = "http://127.0.0.1:5001"
    run_record.write(str(record), cfg, [LOCAL], [], tracking_uri=server)
    out = make_ui(f"RUN_RECORD={record}")
    assert out.returncode == 0 and server in out.stdout and "mlflow ui" not in out.stdout, out
    out = make_ui(f"RUN_RECORD={tmp_path / 'none.json'}")
    assert out.returncode != 0 and "no run recorded here yet" in out.stderr and "mlflow ui" not in out.stdout, out
    out = make_ui(f"RUN_RECORD={tmp_path / 'none.json'}", "UI_STORE=sqlite:////x/mlflow.db")
    assert out.returncode == 0 and "mlflow ui --backend-store-uri sqlite:////x/mlflow.db" in out.stdout, out
