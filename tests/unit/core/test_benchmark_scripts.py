"""Every script in benchmarks/ starts as docs/benchmarks.md runs it, `python benchmarks/<name>.py ...`:
its imports resolve from a script's own sys.path (its folder first, not the repository's root, so
`tests.support` needs the script's own path entry), and its flags parse (`--help` exits 0). The
figures themselves are the benchmarks' to measure; this catches a script that no longer starts.

One child process runs them all in turn (torch is imported once), each with the `sys.path` a script
gets and none of the repository's `tests` or `benchmarks` modules already imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]

CHILD = r"""
import json, runpy, sys
from pathlib import Path

bench = Path(sys.argv[1])
base = [p for p in sys.path if p not in ("", ".")]  # `python -c` puts the working directory first
failed = []
for f in sorted(bench.glob("*.py")):
    for name in [m for m in sys.modules if m.split(".")[0] in ("tests", "benchmarks")]:
        del sys.modules[name]
    sys.path[:] = [str(bench), *base]
    sys.argv = [str(f), "--help"]
    is_script = 'if __name__ == "__main__":' in f.read_text()
    try:
        runpy.run_path(str(f), run_name="__main__")
        if is_script:
            failed.append(f"{f.name}: --help ran the benchmark instead of printing its flags")
    except SystemExit as e:
        if e.code not in (0, None):
            failed.append(f"{f.name}: --help exits {e.code}")
    except BaseException as e:
        failed.append(f"{f.name}: {type(e).__name__}: {e}")
print("FAILED " + json.dumps(failed))
"""


def test_every_benchmark_starts_from_its_documented_command(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", CHILD, str(REPO / "benchmarks")], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert "FAILED " in out.stdout, out.stderr[-3000:]
    failed = json.loads(out.stdout.rsplit("FAILED ", 1)[1])
    assert not failed, "\n".join(failed)
    assert len(list((REPO / "benchmarks").glob("*.py"))) >= 20  # the folder was found
