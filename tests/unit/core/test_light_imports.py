"""What loads torch: the config, the driver and the data stages do not, so a data stage's Ray
workers, `--help` and `--print-config` start without it (~3 s of a process's start on 2 cores);
the model's names still load as before, on first use (`model/__init__.py`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import model

REPO = Path(__file__).resolve().parents[3]
# Modules a process imports without training or decoding: the config, the driver and the DAG, the
# data stages a Ray worker deserializes (prepare's cleaning tasks, encode's actors).
LIGHT = ["pipeline.config", "workflows.reproduce_base", "workflows.runner", "pipeline.data.prepare",
         "pipeline.data.encode", "pipeline.data.vocab", "pipeline.data.download"]


def test_the_config_driver_and_data_stages_import_no_torch():
    code = ("import sys\n"
            f"for m in {LIGHT!r}: __import__(m)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:5])")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", f"torch loaded by one of {LIGHT}: {out}"


def test_every_name_of_model_loads_from_its_module():
    import importlib

    for name in model.__all__:
        value = getattr(model, name)
        defined = [m for m in ("averaging", "compute", "config", "incremental", "search", "training",
                               "transformer") if getattr(importlib.import_module(f"model.{m}"), name, None) is value]
        assert defined, name
    assert {"Transformer", "ModelConfig", "beam_search", "average_checkpoints"} <= set(dir(model))


def test_an_unknown_name_is_an_attribute_error_naming_it():
    try:
        model.NotAName  # noqa: B018
    except AttributeError as e:
        assert "NotAName" in str(e)
    else:
        raise AssertionError("model.NotAName did not raise")
