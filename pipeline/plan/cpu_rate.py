"""This CPU's matmul rate at a training step's own matrix products: what `--plan` bills a CPU run with.

`step_gemms` records the matrix products one micro-batch's forward, loss and backward dispatch
(aten ``mm`` and ``addmm``: every linear layer's forward, its input's gradient and its weight's
gradient, and the output projection over the vocabulary), on the meta device: the real model at
the micro-batch's real shapes (`flops.MicroShape`), as `flops.count_step_flops` counts them, with
each operand's layout (a weight's gradient multiplies a transposed view, and the BLAS call
differs). Attention's batched products are left out: on a CPU they run inside SDPA's fused
kernel, and they are a few percent of a step's counted FLOPs.

`measure` times each distinct product on this CPU in the step's dtype (bf16 where the CPU does
bf16 natively, else fp32: `pipeline.train.device.resolve_precision` decides, its callers pass
the dtype) with the torch threads training gives its worker, and returns a `MatmulRate`: the
rate of each product and the step's rate, their FLOP-weighted harmonic mean (the step's products
counted as often as the step runs them, each at its own measured rate: the seconds a step's
matmuls take at this machine's roofline). About a second for the Multi30k tiny recipe in fp32 on
2 cores (docs/benchmarks.md, "This CPU's matmul rate"); cached per process.
"""

from __future__ import annotations

import collections
import contextlib
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from model import ModelConfig, NonPad, Transformer, label_smoothed_nll
from pipeline.cpu_threads import use_threads
from pipeline.plan.flops import MicroShape

Layout = tuple[tuple[int, int], tuple[int, int]]  # (shape, strides) of a 2-D operand


@dataclass(frozen=True)
class Gemm:
    """One matrix product of a step: (m x k) @ (k x n), with its operands' layouts; addmm adds a bias."""

    a: Layout
    b: Layout
    bias: bool  # addmm (a linear layer's forward with its bias) rather than mm
    count: int = 1  # how many times one micro-batch runs it

    @property
    def mkn(self) -> tuple[int, int, int]:
        return self.a[0][0], self.a[0][1], self.b[0][1]

    @property
    def flops(self) -> int:
        """Of one call: 2 m k n (a multiply and an add per term)."""
        m, k, n = self.mkn
        return 2 * m * k * n

    def label(self) -> str:
        """'3427x128 @ 128x8000ᵀ': ᵀ marks an operand that is a transposed view."""
        t = lambda lay: "ᵀ" if lay[1][0] == 1 and lay[0][1] > 1 else ""  # noqa: E731 (column-major)
        m, k, n = self.mkn
        return f"{m}x{k}{t(self.a)} @ {k}x{n}{t(self.b)}" + (" + bias" if self.bias else "")


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in ("mm", "addmm"):
            a, b = args[-2:]
            self.seen[(tuple(a.shape), tuple(a.stride())), (tuple(b.shape), tuple(b.stride())), name == "addmm"] += 1
        return func(*args, **(kwargs or {}))


def step_gemms(mc: ModelConfig, micro: MicroShape, label_smoothing: float = 0.1) -> list[Gemm]:
    """The matrix products of one micro-batch of shape `micro` (forward, loss, backward), with counts."""
    with torch.device("meta"):
        model = Transformer(mc)
    model.train()
    long = dict(dtype=torch.long, device="meta")
    with _Recorder() as rec:
        src = torch.full((micro.B, micro.S), mc.eos_id, **long)
        tgt_in = torch.full((micro.B, micro.T), mc.bos_id, **long)
        hidden = model(src, tgt_in, NonPad(torch.empty(micro.Ms, **long), torch.empty(micro.Mt, **long)))
        loss, _ = label_smoothed_nll(model.logits(hidden), torch.full((micro.Mt,), mc.eos_id, **long),
                                     epsilon=label_smoothing, ignore_index=mc.pad_id)
        loss.backward()
    return [Gemm(a, b, bias, n) for (a, b, bias), n in sorted(rec.seen.items(), key=lambda kv: repr(kv[0]))]


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op threads `n` (> 0) inside, restored after; set only where the count differs
    (`pipeline.cpu_threads`: setting it slows the process's attention kernels for good)."""
    before = torch.get_num_threads()
    use_threads(n)
    try:
        yield
    finally:
        use_threads(before)


def time_gemm(g: Gemm, dtype: torch.dtype, repeats: int = 5) -> float:
    """Best seconds of one call of `g` on this CPU in `dtype`, after a warm-up call (the BLAS's
    buffers and oneDNN's per-shape kernel are built in it). The best of `repeats`: on a shared
    machine a slow call is another process's, not this CPU's rate."""
    gen = torch.Generator().manual_seed(0)

    def operand(lay: Layout) -> torch.Tensor:
        return torch.empty_strided(lay[0], lay[1], dtype=dtype).uniform_(-1, 1, generator=gen)  # normal_: 3x slower

    a, b = operand(g.a), operand(g.b)
    bias = torch.empty(g.mkn[2], dtype=dtype).uniform_(-1, 1, generator=gen) if g.bias else None
    call = (lambda: torch.addmm(bias, a, b)) if bias is not None else (lambda: torch.mm(a, b))
    call()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - t0)
    return best


@dataclass(frozen=True, kw_only=True)
class MatmulRate:
    """What `measure` found: each product's rate and the step's."""

    dtype: str  # "fp32" | "bf16"
    threads: int
    cpu: str  # `cpu_name()`
    gemms: tuple[tuple[Gemm, float], ...]  # (product, FLOP/s)
    wall_s: float  # what measuring took

    @property
    def flops(self) -> int:
        """One micro-batch's matmul FLOPs (each product times its count)."""
        return sum(g.count * g.flops for g, _ in self.gemms)

    @property
    def seconds(self) -> float:
        """One micro-batch's matmuls at their measured rates."""
        return sum(g.count * g.flops / r for g, r in self.gemms)

    @property
    def rate(self) -> float:
        """The step's matmul rate (FLOP/s): its products' FLOPs over their seconds at the measured rates."""
        return self.flops / self.seconds

    def describe(self) -> str:
        return f"this CPU ({self.cpu}): {self.threads} thread(s), {self.dtype}, measured {self.rate / 1e9:.1f} GFLOP/s"


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux, else the platform's)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_measured: dict[tuple, MatmulRate] = {}


def measure(mc: ModelConfig, micro: MicroShape, precision: str, threads: int, label_smoothing: float = 0.1,
            repeats: int = 5) -> MatmulRate:
    """This CPU's rate at the products of a micro-batch of shape `micro`, in `precision` ("fp32" |
    "bf16") with `threads` torch threads. Cached per process (one --plan, one driver)."""
    if precision not in DTYPES:
        raise ValueError(f"precision {precision!r}: a CPU step runs in one of {', '.join(DTYPES)}")
    key = (tuple(sorted(vars(mc).items())), micro, precision, threads, label_smoothing, repeats)
    if key not in _measured:
        t0 = time.perf_counter()
        gemms = step_gemms(mc, micro, label_smoothing)
        with torch_threads(threads):
            rates = tuple((g, g.flops / time_gemm(g, DTYPES[precision], repeats)) for g in gemms)
        _measured[key] = MatmulRate(dtype=precision, threads=threads, cpu=cpu_name(), gemms=rates,
                                    wall_s=time.perf_counter() - t0)
    return _measured[key]
