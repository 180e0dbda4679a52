"""Prepare-stage benchmark at k x the mirror's size: pairs/s per core and peak memory.

    python benchmarks/prepare_bench.py [--mirror DIR] [--scales 10,100] [--dedup] [--out bench.json]

The mirror's EN-DE training corpora are written repeated k times (``data_bench.make_corpus``: the
same text, so dedup on drops (k-1)/k of it), and ``download`` + ``prepare`` run on them as a custom
corpus with a fresh local Ray of ``--cpus`` CPUs (each scale in its own subprocess). Reported:
prepare wall time, training pairs read per second overall and per core (pairs/s / CPUs), and the
peak summed PSS of the driver and all Ray processes (``data_bench.PeakMemory``) during prepare.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.data_bench import PeakMemory, make_corpus  # noqa: E402


def child(args: argparse.Namespace) -> dict:
    import ray

    from pipeline.config import Config
    from pipeline.data import download, prepare
    from pipeline.stage import Manifest, StageContext

    work = Path(args.work)
    cfg = Config()
    cfg.data.source = "custom"
    for k, v in json.loads(Path(args.files).read_text()).items():
        setattr(cfg.data, k, v)
    cfg.data.num_shards, cfg.data.dedup = 8, args.dedup
    cfg.run.work_dir = str(work / f"run{args.scale}")
    ray.init(address="local", num_cpus=args.cpus, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}})
    dl_dir = Path(cfg.run.work_dir) / "download"
    dl = download.run(StageContext(name="download", key="k", cfg=cfg, out_dir=str(dl_dir), inputs={}))
    dl = Manifest(stage="download", key="k", dir=str(dl_dir), outputs=dl.outputs, metrics=dl.metrics)
    mem = PeakMemory()
    time.sleep(2)
    baseline = mem.sample() / 2**20
    mem.reset()
    t0 = time.perf_counter()
    r = prepare.run(StageContext(name="prepare", key="k", cfg=cfg, out_dir=str(Path(cfg.run.work_dir) / "prepare"),
                                 inputs={"download": dl}))
    wall = time.perf_counter() - t0
    mem.stop()
    pairs = r.outputs["splits"]["train"]["num_read"]
    ray.shutdown()
    return {"scale": args.scale, "dedup": args.dedup, "cpus": args.cpus, "train_pairs_read": pairs,
            "train_rows_kept": r.outputs["splits"]["train"]["num_rows"], "prepare_s": round(wall, 2),
            "pairs_per_s": round(pairs / wall), "pairs_per_s_per_core": round(pairs / wall / args.cpus),
            "idle_mb": round(baseline, 1), "prepare_peak_mb": mem.peaks_mb()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mirror", default=str(REPO.parent / "shared" / "data" / "statmt-mirror"))
    p.add_argument("--scales", default="10,100")
    p.add_argument("--cpus", type=int, default=2)
    p.add_argument("--dedup", action="store_true")
    p.add_argument("--out", default="")
    p.add_argument("--work", default="")
    p.add_argument("--scale", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--files", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.scale:  # the child
        print(json.dumps(child(args)))
        return
    work = Path(args.work or tempfile.mkdtemp(prefix="prepare-bench-"))
    results = []
    for scale in (int(s) for s in args.scales.split(",")):
        files = work / f"files{scale}.json"
        files.write_text(json.dumps(make_corpus(args.mirror, work, scale)))
        cmd = [sys.executable, __file__, "--scale", str(scale), "--files", str(files), "--work", str(work),
               "--cpus", str(args.cpus)] + (["--dedup"] if args.dedup else [])
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=REPO).stdout
        results.append(json.loads(out.strip().splitlines()[-1]))
        print(json.dumps(results[-1]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
