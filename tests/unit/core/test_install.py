"""`make install`: torch's build for the machine, every other package from requirements.lock.

- The Makefile's install target is run with a venv whose `python`, `pip` and `uv` log their arguments and do
  nothing else, and a fake `nvidia-smi` first on PATH: no NVIDIA GPU takes torch from the CPU index,
  one takes PyPI's build, `TORCH_INDEX=URL` takes that index as its own pip argument, and a changed
  `TORCH_INDEX` reinstalls torch although `.installed` exists. The rest is installed from the lock,
  exactly (`--no-deps`), and checked.
- requirements.lock pins every direct dependency of pyproject.toml at a version its pin allows (a
  pyproject.toml edit without `make lock` fails here), leaves torch out, and holds no CUDA runtime.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[3]
LOCK = REPO / "requirements.lock"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
CU128_INDEX = "https://download.pytorch.org/whl/cu128"
TORCH = "torch==2.13.0"
BUILD_STEP = ["pip", "install", "--no-deps", "--force-reinstall", TORCH]

# One JSON list per call: the program's name, then its arguments.
LOGGER = "import json, sys\nwith open(sys.argv[1], 'a') as f:\n    f.write(json.dumps(sys.argv[2:]) + '\\n')\n"
# `nvidia-smi -L` on a machine with a GPU, and on one whose driver does not answer (it prints to stdout
# and fails: the output alone must not count as a GPU).
NVIDIA_SMI = {True: 'echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)"\nexit 0',
              False: "echo \"NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\"\nexit 9"}


class Venv:
    """A stub venv in tmp_path, and `make install` run against it."""

    def __init__(self, tmp_path: Path):
        self.path = tmp_path / "venv"
        self.log = tmp_path / "calls.jsonl"
        self.fake_bin = tmp_path / "fake-bin"
        (self.path / "bin").mkdir(parents=True)
        self.fake_bin.mkdir()
        logger = tmp_path / "logger.py"
        logger.write_text(LOGGER)
        for name in ("python", "pip", "uv"):
            self._script(self.path / "bin" / name, f'exec "{sys.executable}" "{logger}" "{self.log}" {name} "$@"')

    @staticmethod
    def _script(path: Path, body: str) -> None:
        path.write_text(f"#!/bin/sh\n{body}\n")
        path.chmod(0o755)

    def install(self, gpu: bool, *args: str) -> tuple[list[list[str]], str]:
        """Runs `make install ARGS` with an NVIDIA GPU present or not; returns the python, pip and uv calls
        it made (the log starts empty each time) and make's output."""
        self._script(self.fake_bin / "nvidia-smi", NVIDIA_SMI[gpu])
        self.log.unlink(missing_ok=True)
        drop = {"TORCH_INDEX", "TORCH_SPEC", "VENV", "MAKEFLAGS", "MFLAGS", "MAKELEVEL"}
        env = {k: v for k, v in os.environ.items() if k not in drop}
        env["PATH"] = f"{self.fake_bin}:{env['PATH']}"
        out = subprocess.run(["make", "-s", "install", f"VENV={self.path}", *args], cwd=REPO, env=env,
                             capture_output=True, text=True)
        assert out.returncode == 0, out
        calls = [json.loads(line) for line in self.log.read_text().splitlines()] if self.log.exists() else []
        return calls, out.stdout

    def torch_builds(self, calls: list[list[str]]) -> list[list[str]]:
        return [c for c in calls if c[:len(BUILD_STEP)] == BUILD_STEP]


@pytest.fixture
def venv(tmp_path) -> Venv:
    return Venv(tmp_path)


def test_no_nvidia_gpu_takes_torchs_cpu_build(venv):
    calls, out = venv.install(gpu=False)
    assert venv.torch_builds(calls) == [[*BUILD_STEP, "--extra-index-url", CPU_INDEX]], calls
    assert f"its build from {CPU_INDEX} (no NVIDIA GPU" in out, out


def test_an_nvidia_gpu_takes_pypis_build(venv):
    calls, out = venv.install(gpu=True)
    assert venv.torch_builds(calls) == [BUILD_STEP], calls  # no index of its own: PyPI's (the CUDA build)
    assert "its build from PyPI (nvidia-smi -L lists an NVIDIA GPU" in out, out


@pytest.mark.parametrize("gpu, index", [(True, CU128_INDEX), (False, CU128_INDEX), (False, "")])
def test_torch_index_names_the_index(venv, gpu, index):
    calls, _ = venv.install(gpu, f"TORCH_INDEX={index}")
    expected = [*BUILD_STEP, "--extra-index-url", index] if index else BUILD_STEP
    assert venv.torch_builds(calls) == [expected], calls
    # pip's second pass, for what the build needs beyond the lock (a CUDA build's runtime), sees the same index
    assert ["pip", "install", "-c", "requirements.lock", *expected[len(BUILD_STEP) - 1:]] in calls, calls


def test_a_changed_torch_index_reinstalls_torch(venv):
    venv.install(gpu=False)
    assert (venv.path / ".installed").exists()
    assert venv.install(gpu=False)[0] == []  # nothing changed: nothing to do
    calls, _ = venv.install(False, f"TORCH_INDEX={CU128_INDEX}")
    assert venv.torch_builds(calls) == [[*BUILD_STEP, "--extra-index-url", CU128_INDEX]], calls
    assert [p.read_text() for p in venv.path.glob(".torch-*")] == [f"{TORCH} --extra-index-url {CU128_INDEX}\n"]
    assert venv.install(False, f"TORCH_INDEX={CU128_INDEX}")[0] == []
    calls, _ = venv.install(gpu=False)  # back to the detected build
    assert venv.torch_builds(calls) == [[*BUILD_STEP, "--extra-index-url", CPU_INDEX]], calls


def test_install_installs_exactly_the_lock_then_the_project(venv):
    calls, _ = venv.install(gpu=False)
    python = str(venv.path / "bin" / "python")
    uv_install = ["uv", "pip", "install", "--compile-bytecode", "--python", python, "--no-deps"]
    lock = [*uv_install, "-r", "requirements.lock"]
    project = [*uv_install, "-e", "."]
    check = ["uv", "pip", "check", "--python", python]
    assert lock in calls and project in calls and check in calls, calls
    build = calls.index(venv.torch_builds(calls)[0])
    assert build < calls.index(lock) < calls.index(project) < calls.index(check), calls
    # a new lock reinstalls it, and leaves torch's build alone
    calls, _ = venv.install(False, "-W", "requirements.lock")
    assert lock in calls and not venv.torch_builds(calls), calls


# -- requirements.lock ------------------------------------------------------------------------

def _lock() -> tuple[dict[str, str], set[str]]:
    """The lock's pins (name -> version) and the packages uv lists as left out of it."""
    text = LOCK.read_text(encoding="utf-8")
    pin = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;]+)", re.M)
    pins = {canonicalize_name(m[1]): m[2] for m in pin.finditer(text)}
    excluded = text.split("# The following packages were excluded from the output:\n", 1)
    left_out = {canonicalize_name(line[1:].strip()) for line in excluded[1].splitlines()} if len(excluded) == 2 else set()
    return pins, left_out


def _direct_requirements() -> list[Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    return [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["test"]]


def test_the_lock_pins_every_direct_dependency_within_its_pin():
    pins, left_out = _lock()
    wrong = []
    for req in _direct_requirements():
        name = canonicalize_name(req.name)
        if name == "torch":
            assert name in left_out and name not in pins, "the lock must leave torch out: its index picks the build"
        elif name not in pins:
            wrong.append(f"{req}: not in the lock")
        elif not req.specifier.contains(pins[name], prereleases=True):
            wrong.append(f"{req}: the lock has {pins[name]}")
    assert not wrong, f"requirements.lock is out of date with pyproject.toml (run `make lock`): {wrong}"


def test_the_lock_holds_no_cuda_runtime():
    """A CPU install takes every pin of the lock: a CUDA build's runtime wheels (GBs) come with that build."""
    pins, _ = _lock()
    cuda = sorted(n for n in pins if n.startswith(("nvidia-", "cuda-")) or n == "triton")
    assert not cuda, f"requirements.lock pins CUDA packages (resolved with a CUDA build of torch?): {cuda}"


def test_the_makefiles_torch_is_pyprojects():
    spec = re.search(r"^TORCH_SPEC \?= (\S+)$", (REPO / "Makefile").read_text(encoding="utf-8"), re.M)
    torch = [str(r) for r in _direct_requirements() if canonicalize_name(r.name) == "torch"]
    assert spec and [spec[1]] == torch, (spec and spec[1], torch)
