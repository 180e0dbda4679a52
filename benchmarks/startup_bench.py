"""Process start-up: what a fresh Ray worker pays before it does any work, and where it went.

    python benchmarks/startup_bench.py [--repeats 3]

Every Ray task or actor that needs a new worker process pays its imports again, and a test or a
local-mode run starts dozens of them (one table3 test: 55). Two measurements, side by side:

1. Imports with and without bytecode. ``python -c "import M"`` for the modules a worker of ours
   imports, best of ``--repeats``, once with the venv's ``.pyc`` files (``make install`` compiles
   them: uv does not by default) and once as if there were none: ``PYTHONPYCACHEPREFIX`` pointing at
   an empty folder and ``PYTHONDONTWRITEBYTECODE=1`` (set on this machine), so every import compiles
   its source, as each worker did before ``--compile-bytecode``. Ratio = without / with.
2. Ray Data's Parquet listing. ``ray.data.read_parquet`` of 6 small files on a fresh 2-CPU local Ray
   with Ray 2.60's default reader (DataSourceV2, which lists files through a pool of FooterReader
   actors) and with the V1 reader the encode stage uses: wall time of the read and the actors it
   started, each in its own subprocess (its own Ray).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODULES = ["ray", "ray.data", "ray.train", "mlflow", "torch", "sacrebleu", "pipeline.train.driver",
           "pipeline.evaluate.translate"]

READ = r"""
import json, os, sys, time
import pyarrow as pa, pyarrow.parquet as pq
import ray
from ray.util.state import list_actors
v2, folder = sys.argv[1] == "v2", sys.argv[2]
paths = []
for i in range(6):
    paths.append(os.path.join(folder, f"shard-{i}.parquet"))
    pq.write_table(pa.table({"idx": list(range(i * 1000, (i + 1) * 1000)), "src": ["a sentence"] * 1000}),
                   paths[-1])
ray.init(num_cpus=2, log_to_driver=False, include_dashboard=True)
ray.data.DataContext.get_current().use_datasource_v2 = v2
t0 = time.perf_counter()
ds = ray.data.read_parquet(paths, include_paths=True)
rows = sum(len(b) for b in ds.iter_batches(batch_format="pyarrow", batch_size=None))
wall = time.perf_counter() - t0
actors = [a.class_name for a in list_actors(limit=1000)]
print(json.dumps({"rows": rows, "wall_s": wall, "actors": len(actors),
                  "footer_readers": actors.count("FooterReader")}))
ray.shutdown()
"""


def import_seconds(module: str, repeats: int, env: dict[str, str]) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", f"import {module}"], cwd=REPO, env=env, check=True)
        best = min(best, time.perf_counter() - t0)
    return best


def read_parquet(v2: bool) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        out = subprocess.run([sys.executable, "-c", READ, "v2" if v2 else "v1", folder], cwd=REPO,
                             capture_output=True, text=True, env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    base = {**os.environ, "PYTHONPATH": str(REPO)}
    results: dict = {"imports": {}}
    with tempfile.TemporaryDirectory() as empty:
        cold = {**base, "PYTHONPYCACHEPREFIX": empty, "PYTHONDONTWRITEBYTECODE": "1"}
        print(f"{'import (best of %d)' % args.repeats:30s} {'with .pyc':>10s} {'without':>10s} {'ratio':>7s}")
        for m in MODULES:
            warm, no_pyc = import_seconds(m, args.repeats, base), import_seconds(m, args.repeats, cold)
            results["imports"][m] = {"with_pyc_s": warm, "without_pyc_s": no_pyc}
            print(f"{m:30s} {warm:9.2f}s {no_pyc:9.2f}s {no_pyc / warm:6.2f}x")
    v2, v1 = read_parquet(True), read_parquet(False)
    results["read_parquet"] = {"v2_default": v2, "v1": v1}
    print(f"\n{'read_parquet, 6 files, 2-CPU Ray':34s} {'wall':>7s} {'actors':>7s} {'FooterReader':>13s}")
    for name, r in (("DataSourceV2 (Ray 2.60 default)", v2), ("V1 (the encode stage)", v1)):
        print(f"{name:34s} {r['wall_s']:6.1f}s {r['actors']:7d} {r['footer_readers']:13d}")
    print(f"ratio V2 / V1 wall: {v2['wall_s'] / v1['wall_s']:.2f}x")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
