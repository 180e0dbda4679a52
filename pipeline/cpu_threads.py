"""How many threads torch computes with on a CPU: the one place that sets it.

``torch.set_num_threads`` is not free. In torch 2.13 (OpenMP build, MKL), a process that has
called it, even with the count it already had, runs the CPU flash-attention kernels of
``F.scaled_dot_product_attention`` 2-3x slower from then on, slower than one thread that never
called it: a sixth of the train stage's step on the Multi30k tiny recipe (docs/benchmarks.md,
"Where the train stage's step went"; `benchmarks/threads_bench.py`).
So the count is set only where it differs: a process that starts with the threads it will use
(torch's default, one per core, or OMP_NUM_THREADS) never calls it.
"""

from __future__ import annotations

import torch


def use_threads(n: int) -> None:
    """Compute with `n` torch threads (0: as the process has them), calling torch.set_num_threads only
    when the count differs."""
    if n > 0 and torch.get_num_threads() != n:
        torch.set_num_threads(n)

