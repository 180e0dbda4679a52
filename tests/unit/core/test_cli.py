"""`transformer-repro` (workflows/cli.py) and what its run/plan share with workflows/reproduce_base.py:
the subcommands, `--help` listing every config key with its default and meaning (generated from the
schema's comments: pipeline/config/reference.py), `--print-config`, `plan` = `run --plan`, `serve`'s
arguments, and the console script pyproject.toml declares."""

from __future__ import annotations

import dataclasses
import importlib
import re
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

from pipeline.config import Config, from_dict, load_config
from pipeline.config.reference import field_comment, to_toml
from workflows import cli, reproduce_base

REPO = Path(__file__).resolve().parents[3]
LOCAL = str(REPO / "configs" / "local.toml")


def _exit_output(capsys, main, argv: list[str]) -> str:
    """What `main(argv)` prints before it exits 0 (argparse's --help)."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0
    return capsys.readouterr().out


def test_help_lists_the_subcommands(capsys):
    out = _exit_output(capsys, cli.main, ["--help"])
    listed = set(re.findall(r"^    (\w+)", out.split("positional arguments:", 1)[1], flags=re.M))
    assert {"run", "plan", "serve", "translate", "table3"} <= listed, out


def test_no_or_an_unknown_subcommand_is_a_usage_error(capsys):
    for argv in ([], ["fly"]):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == 2
    assert "invalid choice: 'fly'" in capsys.readouterr().err


def _schema_defaults() -> dict[str, object]:
    """`section.key` -> default, walking the dataclasses themselves."""
    out = {}
    for section in dataclasses.fields(Config):
        for f in dataclasses.fields(section.default_factory()):
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            out[f"{section.name}.{f.name}"] = default
    return out


@pytest.mark.parametrize("entry", [(cli.main, ["run", "--help"]), (cli.main, ["plan", "--help"]),
                                   (reproduce_base.main, ["--help"])],
                         ids=["transformer-repro run", "transformer-repro plan", "reproduce_base.py"])
def test_help_lists_every_config_key_with_its_default_and_meaning(capsys, entry):
    main, argv = entry
    lines = _exit_output(capsys, main, argv).splitlines()
    shown = {}  # section.key -> (default as printed, the line after it)
    for i, line in enumerate(lines):
        if m := re.match(r"^  --([a-z_]+\.[a-z0-9_]+)=(.*?)  \(", line):
            shown[m.group(1)] = (m.group(2), lines[i + 1] if i + 1 < len(lines) else "")
    schema = _schema_defaults()
    assert sorted(shown) == sorted(schema)
    for key, default in schema.items():
        printed, meaning = shown[key]
        value = None if printed == "none" else tomllib.loads(f"v = {printed}")["v"]
        assert value == default and type(value) is type(default), f"{key}: --help shows {printed}, schema {default!r}"
        assert meaning.startswith("      ") and meaning.strip(), f"{key}: no meaning under it in --help"
    assert "[train] The paper's training recipe" in "\n".join(lines)  # a section's docstring


def test_field_comment_reads_the_lines_above_and_the_comment_beside(tmp_path, monkeypatch):
    source = textwrap.dedent('''\
        from dataclasses import dataclass, field


        @dataclass
        class Base:
            """Doc."""

            # above a,
            # on two lines
            a: int = 1  # and beside a
            b: str = "x # not a comment"  # beside b

            # a note a blank line away belongs to no field

            c: float = 2.0
            d: list[str] = field(
                default_factory=list)  # beside d's last line
            s: str = """a string whose last line
        # starts with a hash"""
            g: int = 0


        @dataclass
        class Child(Base):
            e: int = 0
        ''')
    (tmp_path / "commented_schema.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("commented_schema")
    monkeypatch.setitem(sys.modules, "commented_schema", module)
    assert field_comment(module.Child, "a") == "above a, on two lines and beside a"  # inherited: Base's source
    assert field_comment(module.Base, "b") == "beside b"
    assert field_comment(module.Base, "c") == ""
    assert field_comment(module.Base, "d") == "beside d's last line"
    assert field_comment(module.Base, "g") == ""  # the line above is inside a string
    assert field_comment(module.Child, "e") == ""


def test_print_config_prints_the_resolved_config_and_runs_nothing(capsys, tmp_path):
    work = tmp_path / "work"
    overrides = [f"--run.work_dir={work}", "--train.max_steps=7", "--score.splits=test,dev", "--model.d_k=16"]
    assert cli.main(["run", "--config", LOCAL, *overrides, "--print-config"]) == 0
    printed = capsys.readouterr().out
    data = tomllib.loads(printed)
    assert data["train"]["max_steps"] == 7 and data["score"]["splits"] == ["test", "dev"]
    assert "d_v" not in data["model"]  # unset: left out, as TOML has no None
    assert from_dict(data) == load_config(LOCAL, overrides)
    assert not work.exists()  # no preflight, no plan, no run


def test_print_config_round_trips_every_string(tmp_path):
    cfg = Config()
    cfg.run.name = 'a "quoted" \\ back\tslash\nline ü \x01 \x7f'
    cfg.data.train_src, cfg.data.train_tgt = ["x.en", "y'.en"], ["x.de", "y'.de"]
    cfg.train.adam_eps, cfg.checkpoint.interval_s = 1e-9, 1e16
    path = tmp_path / "printed.toml"
    path.write_text(to_toml(cfg), encoding="utf-8")
    assert load_config(path) == cfg


def test_plan_is_run_with_plan(capsys, tmp_path, monkeypatch):
    """`plan` takes the --plan path of reproduce_base.main: the stage table and the train stage's
    bill, on an empty work dir that it leaves empty."""
    work = tmp_path / "work"
    assert cli.main(["plan", "--config", LOCAL, f"--run.work_dir={work}"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^train +[0-9a-f]{16} +run +never ran with this config$", out, flags=re.M), out
    assert "bill of the train stage" in out and "parameters at vocab.size 4000" in out
    assert not work.exists() or not any(work.iterdir())

    calls = []
    monkeypatch.setattr(reproduce_base, "main", lambda argv, prog=None: calls.append(argv) or 0)
    assert cli.main(["plan", "--config", LOCAL, "--to", "vocab"]) == 0
    assert calls == [["--plan", "--config", LOCAL, "--to", "vocab"]]


def test_serve_serves_the_run_record_as_make_serve_does(tmp_path, monkeypatch, capsys):
    record = tmp_path / "last-run.json"
    with pytest.raises(SystemExit) as e:  # no record yet: say so, start nothing
        cli.serve_args(["--record", str(record)])
    assert e.value.code == 2 and f"no trained model yet ({record}" in capsys.readouterr().err
    record.write_text("{}")
    served = []
    monkeypatch.setattr(cli, "serve_cli", lambda args: served.append(args) or 0)
    assert cli.main(["serve", "--record", str(record), "backend=ctranslate2", "num_replicas=2"]) == 0
    assert served == [["run", "pipeline.serve.app:build_app", f"run_record={record}", "backend=ctranslate2",
                       "num_replicas=2"]]
    # a model named otherwise: no run record added, none needed
    assert cli.serve_args(["--record", str(tmp_path / "none.json"), "model=models:/m/1"]) == [
        "run", "pipeline.serve.app:build_app", "model=models:/m/1"]


def test_translate_and_table3_are_their_own_clis(capsys):
    out = _exit_output(capsys, cli.main, ["translate", "--help"])
    assert out.startswith("usage: transformer-repro translate") and "Translate stdin" in out
    out = _exit_output(capsys, cli.main, ["table3", "--help"])
    assert out.startswith("usage: transformer-repro table3") and "--rows" in out


def test_the_console_script_is_declared_and_its_target_imports():
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]["scripts"]
    module, _, name = scripts["transformer-repro"].partition(":")
    assert callable(getattr(importlib.import_module(module), name))
    assert getattr(importlib.import_module(module), name) is cli.main


def test_a_failed_download_is_one_line_naming_its_url(tmp_path, monkeypatch, capsys):
    """A stage's DataError (statmt.org unreachable, a checksum that differs) ends the run with exit 2
    and the error's own line, not a traceback."""
    from contextlib import contextmanager

    from pipeline.data.fetch import DataError
    from workflows import reproduce_base, runner

    @contextmanager
    def no_ray(cfg, start_ray=True, runs=()):
        class Session:
            @contextmanager
            def parent_run(self, tags):
                yield None
        yield Session()

    def download(cfg, plans, tracking):
        raise DataError("cannot download http://statmt.org/wmt14/dev.tgz after 5 attempts: no route")

    monkeypatch.setattr(reproduce_base, "driver_session", no_ray)
    monkeypatch.setattr(runner, "execute", download)
    rc = reproduce_base.main(["--config", "configs/local.toml", f"--run.work_dir={tmp_path}"])
    assert rc == 2
    assert capsys.readouterr().err.strip() == ("error: cannot download http://statmt.org/wmt14/dev.tgz after 5 "
                                               "attempts: no route")
