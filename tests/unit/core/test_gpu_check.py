"""benchmarks/gpu_check.py is the one command for a bare CUDA image (torch, numpy, pyarrow,
sentencepiece; none of Ray, MLflow, sacremoses, CTranslate2, transformers, FastAPI): its --smoke
runs every section on the CPU in a subprocess where those packages cannot be imported, so a
change that makes the GPU check depend on one of them fails here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "benchmarks"))

from gpu_sections import largest_fitting  # noqa: E402

# The six, and the project's other dependencies that a bare CUDA image lacks.
BLOCKED = ("ray", "mlflow", "sacremoses", "ctranslate2", "transformers", "fastapi",
           "matplotlib", "s3fs", "boto3", "psutil")
# The CUDA image has pandas and sacrebleu (the device tool's KINDS.md): the Multi30k section scores
# with sacrebleu. The rest of the check imports neither: the smoke test below blocks them too.

WRAPPER = """
import runpy, sys
BLOCKED = set(sys.argv[1].split(","))
class Hidden:
    # Wraps each import finder so that the blocked packages are not found: `import ray` raises
    # ModuleNotFoundError and importlib.util.find_spec("ray") is None, as on a machine without them.
    def __init__(self, inner):
        self.inner = inner
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            return None
        return self.inner.find_spec(name, path, target)
    def __getattr__(self, attr):
        return getattr(self.inner, attr)
sys.meta_path[:] = [Hidden(f) for f in sys.meta_path]
sys.argv = [sys.argv[2], *sys.argv[3:]]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
finally:
    leaked = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
    assert not leaked, f"imported anyway: {leaked}"
"""

SECTIONS = ("train base eager", "host syncs", "step profile", "checkpoint stall", "ddp nccl", "fit base", "beam-4 decode",
            "train base compiled", "train big eager", "fit big", "train big compiled")


@pytest.mark.slow
def test_smoke_runs_every_section_without_the_projects_heavy_dependencies(tmp_path):
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    blocked = ",".join(BLOCKED + ("sacrebleu", "pandas"))
    proc = subprocess.run([sys.executable, "-c", WRAPPER, blocked, str(REPO / "benchmarks/gpu_check.py"),
                           "--smoke", "--json", str(out), "--multi30k", str(tmp_path / "no-bundle")], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["smoke"]  # and no section has a time budget: a busy CPU only makes it slower
    assert all(s.get("budget_s") is None for s in report["sections"].values())
    for name in SECTIONS:
        assert report["sections"][name]["status"] == "ok", (name, report["sections"][name])
        assert name in proc.stdout
    ct2 = report["sections"]["ctranslate2 decode"]
    assert ct2["status"] == "skipped" and "ctranslate2 package is not installed" in ct2["reason"]
    assert report["env"]["optional"] == {"ctranslate2": False, "transformers": False, "ray": False, "mlflow": False}
    assert report["sections"]["train base eager"]["tgt_tokens_per_s"] > 0
    decode = report["sections"]["beam-4 decode"]
    assert decode["sentences_per_s"] > 0
    # a decoding step's host cost: its layers' ops, and at most two waits for the device (the eos
    # test and the done test) plus the rare drop of finished sentences
    assert decode["aten_ops_per_decode_step"] > 20 and 1 <= decode["device_waits_per_decode_step"] <= 3
    profile = report["sections"]["step profile"]  # what a step dispatches: the figure a GPU's launches follow
    assert profile["aten_ops_per_step"] > 50 and "top_host_ops" in profile
    m30k = report["sections"]["multi30k tiny recipe"]
    assert m30k["status"] == "skipped" and "no bundle" in m30k["reason"]


def _threshold(limit: int, calls: list[int]):
    def fits(n: int) -> bool:
        calls.append(n)
        return n <= limit
    return fits


@pytest.mark.parametrize("limit", [25000, 37000, 99999, 310000, 1_999_999])
def test_largest_fitting_brackets_the_limit_within_the_tolerance(limit):
    calls: list[int] = []
    good, bad = largest_fitting(_threshold(limit, calls), 25000, 2_000_000, rel_tol=0.05)
    assert good <= limit < bad and bad - good <= 0.05 * good
    assert len(calls) <= 16  # doubling, then bisection: a handful of probes, not a scan


def test_largest_fitting_when_nothing_or_everything_fits():
    assert largest_fitting(_threshold(10, []), 25000, 2_000_000) == (0, 25000)
    assert largest_fitting(_threshold(10**9, []), 25000, 2_000_000) == (2_000_000, None)
