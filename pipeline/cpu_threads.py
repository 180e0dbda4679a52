"""How many threads torch computes with on a CPU: the one place that sets it.

``torch.set_num_threads`` is not free. In torch 2.13 (OpenMP build, MKL), a process that has
called it, even with the count it already had, runs the CPU flash-attention kernels of
``F.scaled_dot_product_attention`` 2-3x slower from then on (fwd + bwd at the Multi30k tiny
recipe's shapes: 6 ms before, 14-16 ms after, on 2 cores; slower than one thread that never
called it), which cost the train stage ~15% of its step against the same step in a fresh
process (docs/benchmarks.md, "Where the train stage's step went"). So the count is set only where it
differs, and a Ray worker that will compute with n threads is started with OMP_NUM_THREADS=n
(`worker_env`) so that it already has them.
"""

from __future__ import annotations

import torch


def use_threads(n: int) -> None:
    """Compute with `n` torch threads (0: as the process has them), calling torch.set_num_threads only
    when the count differs."""
    if n > 0 and torch.get_num_threads() != n:
        torch.set_num_threads(n)


def worker_env(n: int) -> dict[str, str]:
    """Environment variables of a Ray worker process that will compute with `n` threads (Ray sets
    OMP_NUM_THREADS to the task's CPU count otherwise: 1 for a task holding none or one)."""
    return {"OMP_NUM_THREADS": str(n)} if n > 0 else {}
