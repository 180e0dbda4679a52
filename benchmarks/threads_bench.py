"""What calling torch.set_num_threads costs a CPU process: attention and a matmul, in fresh processes.

    .venv/bin/python benchmarks/threads_bench.py [--repeats 5]

Each row is a new Python process (a thread count, once set, stays for the process): the CPU flash
attention of `F.scaled_dot_product_attention` (forward + backward, with a key-padding mask, at the
Multi30k tiny recipe's shape (242, 4, 15, 32)) and the output projection's forward matmul
(3400 x 128 @ 128 x 8000), best of --repeats, in a process that
  - never calls torch.set_num_threads (torch's default: one thread per core),
  - calls it with the count it already has (what a worker did before `pipeline.cpu_threads`),
  - calls `pipeline.cpu_threads.use_threads` with that count (the product's rule: no call).
Run it alone: on 2 cores another torch job makes every figure worthless.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, sys, time
sys.path.insert(0, {repo!r})
import torch
import torch.nn.functional as F
mode, repeats = {mode!r}, {repeats}
n = torch.get_num_threads()
if mode == "set_num_threads":
    torch.set_num_threads(n)
elif mode == "use_threads":
    from pipeline.cpu_threads import use_threads
    use_threads(n)
torch.set_flush_denormal(True)
g = torch.Generator().manual_seed(0)
B, h, T, hs = 242, 4, 15, 32
q, k, v = (torch.randn(B, h, T, hs, generator=g, requires_grad=True) for _ in range(3))
mask = (torch.arange(T)[None, :] < torch.randint(T // 2, T + 1, (B, 1), generator=g))[:, None, None, :]
def best(fn, inner):
    fn()
    out = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        out = min(out, (time.perf_counter() - t0) / inner)
    return 1e3 * out
a, b = torch.randn(3400, 128, generator=g), torch.randn(128, 8000, generator=g)
print(json.dumps({{"threads": n,
                   "sdpa_ms": best(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask).sum().backward(), 10),
                   "mm_ms": best(lambda: a @ b, 3)}}))
"""


def child(mode: str, repeats: int) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD.format(repo=str(REPO), mode=mode, repeats=repeats)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2, help="each mode this many times, alternating")
    args = p.parse_args()
    modes = ("never", "set_num_threads", "use_threads")
    best: dict[str, dict] = {}
    for _ in range(args.rounds):
        for mode in modes:
            r = child(mode, args.repeats)
            if mode not in best or r["sdpa_ms"] < best[mode]["sdpa_ms"]:
                best[mode] = r
    base = best["never"]
    print(f"{'process':>34} {'threads':>8} {'SDPA fwd+bwd ms':>16} {'/ never':>8} {'mm ms':>7} {'/ never':>8}")
    for mode in modes:
        r = best[mode]
        print(f"{mode:>34} {r['threads']:>8} {r['sdpa_ms']:>16.2f} {r['sdpa_ms'] / base['sdpa_ms']:>7.2f}x "
              f"{r['mm_ms']:>7.1f} {r['mm_ms'] / base['mm_ms']:>7.2f}x")


if __name__ == "__main__":
    main()
