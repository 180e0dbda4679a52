"""Dedup of n unique pairs: the per-chunk ``np.union1d`` of the previous prepare vs ``pipeline.data.dedup``.

    python benchmarks/dedup_bench.py [--sizes 1000000,4000000,16000000] [--chunk 20000]

Feeds random 64-bit hashes (all unique: the worst case for a structure of the pairs seen so far)
in chunks of ``--chunk`` rows, as prepare's driver does, then asks for the duplicates. Reports
wall time, ns per pair and the peak of numpy's allocations (tracemalloc), each size in its own
subprocess. The old ``Deduper`` is reproduced here from git history (pipeline/data/clean.py at
4770afe) because prepare no longer uses it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


class UnionDeduper:  # pipeline/data/clean.py's Deduper before this change, verbatim in behaviour
    def __init__(self) -> None:
        self.seen = np.empty(0, dtype=np.uint64)

    def keep_mask(self, hashes: np.ndarray) -> np.ndarray:
        _, first = np.unique(hashes, return_index=True)
        keep = np.zeros(len(hashes), dtype=bool)
        keep[first] = True
        if len(self.seen):
            pos = np.searchsorted(self.seen, hashes)
            pos[pos == len(self.seen)] = 0
            keep &= self.seen[pos] != hashes
        self.seen = np.union1d(self.seen, hashes[keep])
        return keep


def run_one(kind: str, n: int, chunk: int) -> dict:
    from pipeline.data import dedup

    rng = np.random.default_rng(0)
    tracemalloc.start()
    t0 = time.perf_counter()
    if kind == "union1d":
        d = UnionDeduper()
        kept = 0
        for start in range(0, n, chunk):
            kept += int(d.keep_mask(rng.integers(0, 2**64, size=min(chunk, n - start), dtype=np.uint64)).sum())
    else:
        d = dedup.Deduper()
        for start in range(0, n, chunk):
            d.add(rng.integers(0, 2**64, size=min(chunk, n - start), dtype=np.uint64))
        dups = d.duplicates()
        kept = sum(int(dedup.keep_mask(dups, s, min(chunk, n - s)).sum()) for s in range(0, n, chunk))
        d.close()
    wall = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1]
    return {"kind": kind, "pairs": n, "kept": kept, "wall_s": round(wall, 2), "ns_per_pair": round(1e9 * wall / n),
            "peak_numpy_mb": round(peak / 2**20, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1000000,4000000,16000000")
    p.add_argument("--chunk", type=int, default=20_000)
    p.add_argument("--kinds", default="union1d,buckets")
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        kind, n = args.child.split(":")
        print(json.dumps(run_one(kind, int(n), args.chunk)))
        return
    for n in (int(s) for s in args.sizes.split(",")):
        for kind in args.kinds.split(","):
            out = subprocess.run([sys.executable, __file__, "--child", f"{kind}:{n}", "--chunk", str(args.chunk)],
                                 check=True, capture_output=True, text=True, cwd=REPO).stdout
            print(out.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
