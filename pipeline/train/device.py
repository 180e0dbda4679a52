"""How a worker runs on its device: precision (`speed.precision`), attention kernel
(`speed.attention_backend`) and compilation (`speed.compile`). Torch only (no Ray, no MLflow): the
GPU check runs it on a bare CUDA image. `WorkerDevice` is the Trainer's part that holds them.

Precision. "auto" (the default) = bf16 autocast where the device does bf16 natively, fp32 otherwise:
- CUDA: bf16 when `torch.cuda.is_bf16_supported()` (Ampere and later), else fp16 with a GradScaler;
- CPU: bf16 when the CPU has AVX512-BF16 or AMX instructions (oneDNN's bf16 matmuls, faster than
  fp32: docs/benchmarks.md, "bf16 autocast on this CPU"), else fp32.
"bf16" asked for on a CPU without those instructions is an error (emulated bf16 is slower than
fp32 there, and silently training in another precision than asked is worse); so is "fp16" on a
CPU.

Attention. PyTorch picks an SDPA backend by rule, not by speed; on Hopper it picks cuDNN's, which
builds a plan per shape (docs/benchmarks.md, "The GPU step"). "auto" times each candidate (flash,
memory-efficient, cuDNN) first in PyTorch's priority list, on what a layer's attention does (one
causal, two key-padding-masked calls, forward and backward) at a training-sized shape of this
model, and keeps the fastest for the run; a named backend is put first as it is. The others stay
behind it, so a call the chosen kernel cannot run (flash takes no mask) falls back instead of
failing. On a CPU "auto" leaves PyTorch's choice (its flash kernel; the model runs bf16 attention
in fp32 there, `model.transformer._sdpa`).

Compilation. Token-bucketed batches give every micro-batch new shapes (B pairs, S and T columns,
Ms and Mt real positions). A model compiled for static shapes would recompile for each one, and
once dynamo's recompile limit (8 per code object) is reached it silently runs the rest eagerly: a
compiled run slower than eager with nobody told. So the model is compiled with ``dynamic=True``
(every dimension symbolic from the first call) and `CountingBackend` counts the graphs the backend
is handed: the first compilation, every recompilation and every piece a graph break leaves. The
loop logs the count (`WorkerDevice.compiler.num_graphs`) as ``train/compiled_graphs`` and puts it
in its summary, gpu_check reports it, and tests/unit/train/test_compile.py bounds it.
Duck sizing is turned off: by default dynamo gives dimensions that happen to be equal in the first
batch it sees one symbol and guards on the equality (a first micro-batch whose source and target
are both 35 columns wide), so the first batch where they differ would recompile. What is left
(tests/unit/train/test_compile.py, token-bucketed batches, 300 steps; 4 graphs on a tiny model): at
the first step the training forward (twice: dynamo hands it over twice on its first call, no guard
failure logged), at the first validation one for grad mode off and one for a dev batch of a single
pair (dynamo always specializes sizes 0 and 1); nothing after that, however many steps and shapes
follow. The dev loss passes host-computed positions, as training does: a `nonzero` inside the
model would break the graph into pieces that recompile.
"""

from __future__ import annotations

import contextlib
import functools
import getpass
import logging
import os
import re
import tempfile
import time
import typing
from pathlib import Path
from typing import Any, Callable, ContextManager

import torch
import torch.fx.experimental._config  # noqa: F401 (use_duck_shape, below)
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from pipeline.config import ConfigError, Precision, SpeedSection
from pipeline.cpu_threads import use_threads
from pipeline.config.devices import on_for
from pipeline.train.step import FusedOutput, LossSettings

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# Precision

CHOICES = typing.get_args(Precision)


def cpu_bf16_features() -> list[str]:
    """The native-bf16 instruction sets of this CPU that torch sees ([] = none)."""
    found = []
    for name, probe in (("AVX512-BF16", "_is_avx512_bf16_supported"), ("AMX", "_is_amx_tile_supported")):
        fn = getattr(torch.cpu, probe, None)  # private probes (torch >= 2.3); read /proc if absent
        if fn is not None:
            if fn():
                found.append(name)
        elif _cpuinfo_has({"AVX512-BF16": "avx512_bf16", "AMX": "amx_bf16"}[name]):
            found.append(name)
    return found


def _cpuinfo_has(flag: str) -> bool:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(flag in line.split() for line in text.splitlines() if line.startswith("flags"))


def resolve_precision(requested: str, device: torch.device) -> str:
    """The precision a worker on `device` trains in ("bf16" | "fp16" | "fp32") for `speed.precision`."""
    if requested not in CHOICES:
        raise ConfigError(f"speed.precision = {requested!r}: must be one of {', '.join(CHOICES)}")
    if device.type == "cuda":
        if requested == "fp32":
            return "fp32"
        if requested in ("bf16", "auto") and not torch.cuda.is_bf16_supported():
            log.warning("speed.precision=%s: this GPU has no bf16; using fp16 with a GradScaler", requested)
            return "fp16"
        return "bf16" if requested == "auto" else requested
    if requested == "fp32":
        return "fp32"
    features = cpu_bf16_features()
    if requested == "fp16":
        raise ConfigError("speed.precision = 'fp16' is for GPUs without bf16; on a CPU use 'auto', 'bf16' "
                          "or 'fp32'")
    if requested == "bf16" and not features:
        raise ConfigError("speed.precision = 'bf16' but this CPU has no native bf16 (neither AVX512-BF16 nor "
                          "AMX): emulated bf16 is slower than fp32; set speed.precision = 'auto' or 'fp32'")
    return "bf16" if features else "fp32"


def row_multiple(precision: str, device: torch.device) -> int:
    """What a training micro-batch's computed positions are rounded up to (`feeder.collate`):
    64 for bf16 on a CPU, else 1. oneDNN builds (JIT-compiles) a bf16 GEMM kernel per shape and
    keeps ~1024 of them; token-bucketed batches have new shapes every step, so unrounded, local
    mode's real batches spent the bf16 gain building kernels (0.95x fp32; 1.17x rounded to 64,
    docs/benchmarks.md). fp32 GEMMs (MKL) and GPUs pay nothing per shape."""
    return 64 if precision == "bf16" and device.type == "cpu" else 1


def describe(requested: str, device: torch.device) -> str:
    """One log line: what `requested` resolves to on `device`, and why (raises as resolve_precision)."""
    chosen = resolve_precision(requested, device)
    if device.type == "cuda":
        why = torch.cuda.get_device_name(device)
    else:
        features = cpu_bf16_features()
        why = f"CPU with {' and '.join(features)}" if features else "CPU without native bf16"
    return f"speed.precision={requested} -> {chosen} ({why})"


# ---------------------------------------------------------------------------------------------
# Attention backend

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
GPU_CANDIDATES = ("flash", "efficient", "cudnn")
ORDER = ("cudnn", "flash", "efficient", "math")  # the rest, after the chosen one: PyTorch's own preference


def priority(name: str) -> list[SDPBackend]:
    """`name` first, then every other backend (math last): a call the chosen kernel cannot run (flash
    takes no padding mask, so the encoder's and the cross-attention's calls) falls back, never fails."""
    return [BACKENDS[name]] + [BACKENDS[n] for n in ORDER if n != name]


def time_backend(name: str, shape: tuple[int, int, int, int], device: torch.device, dtype: torch.dtype,
                 repeats: int = 5) -> float:
    """Median seconds of what a layer's attention does, forward + backward, with `name` first
    (`priority`): a causal self-attention (the decoder's) and two with a key-padding mask (the
    encoder's and the cross-attention's) on (B, h, T, hs); inf when even the fallbacks cannot run."""
    B, h, T, hs = shape
    q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    keep = torch.arange(T, device=device)[None, :] < torch.randint(T // 2, T + 1, (B, 1), device=device)
    mask = keep[:, None, None, :]  # (B, 1, 1, T): True = a real key, as the model's
    times = []
    try:
        with sdpa_kernel(priority(name), set_priority=True):
            for _ in range(repeats + 1):  # the first builds plans and picks kernels: not timed
                t0 = time.perf_counter()
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True).sum()
                for _ in range(2):
                    out = out + F.scaled_dot_product_attention(q, k, v, attn_mask=mask).sum()
                out.backward()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                times.append(time.perf_counter() - t0)
    except RuntimeError as e:  # "No available kernel" and the like
        log.debug("SDPA with %s first cannot run %s %s: %s", name, shape, dtype, e)
        return float("inf")
    return sorted(times[1:])[len(times[1:]) // 2]


def fastest(names: tuple[str, ...], shape: tuple[int, int, int, int], device: torch.device,
            dtype: torch.dtype) -> tuple[str | None, dict[str, float]]:
    """(the fastest backend's name, or None if none runs; seconds of each)."""
    timings = {n: time_backend(n, shape, device, dtype) for n in names}
    best = min(timings, key=timings.get)
    return (best if timings[best] != float("inf") else None), timings


def attention_context(setting: str, device: torch.device, n_heads: int, head_dim: int, dtype: torch.dtype,
                      tokens: int = 6144, length: int = 32) -> tuple[Callable[[], ContextManager], str]:
    """(a context factory the steps run in, a log line saying what was chosen and why)."""
    if setting != "auto":
        backends = priority(setting)
        return (lambda: sdpa_kernel(backends, set_priority=True)), f"speed.attention_backend = {setting} (first)"
    if device.type != "cuda":
        return contextlib.nullcontext, "speed.attention_backend = auto: PyTorch's choice on a CPU"
    shape = (max(1, tokens // length), n_heads, length, head_dim)
    best, timings = fastest(GPU_CANDIDATES, shape, device, dtype)
    shown = ", ".join(f"{n} {t * 1e3:.2f} ms" if t != float("inf") else f"{n} cannot run" for n, t in timings.items())
    if best is None:
        return contextlib.nullcontext, f"speed.attention_backend = auto: none of {shown}; PyTorch's choice"
    backends = priority(best)
    return ((lambda: sdpa_kernel(backends, set_priority=True)),
            f"speed.attention_backend = auto -> {best} first (a layer's three attentions, fwd+bwd at {shape}: {shown})")


# ---------------------------------------------------------------------------------------------
# Compilation

class CountingBackend:
    """A torch.compile backend that hands each graph to `backend` and counts them."""

    def __init__(self, backend: str = "inductor"):
        from torch._dynamo import lookup_backend

        self.name = backend
        self.inner = lookup_backend(backend)
        self.num_graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        self.num_graphs += 1
        log.info("torch.compile (%s): graph %d (%d nodes)", self.name, self.num_graphs, len(gm.graph.nodes))
        return self.inner(gm, example_inputs)


# The inductor cache folder this process was started with (None: inductor's default). Read at
# import: inductor writes its default into the environment the first time it looks for its cache
# (`torch._dynamo.reset()` does), so the environment later no longer says whether the user chose it.
_INDUCTOR_CACHE_AT_START = os.environ.get("TORCHINDUCTOR_CACHE_DIR")


def inductor_cache_per_capability() -> str | None:
    """With `ATEN_CPU_CAPABILITY` set, and no `TORCHINDUCTOR_CACHE_DIR` when the process started:
    a cache folder of its own for inductor, named by the capability; the folder, or None.

    Inductor generates CPU code for the vector instructions `ATEN_CPU_CAPABILITY` names, but code it
    cached under one value is loaded under another: on an AVX-512 machine (torch 2.13), a compiled
    run under `ATEN_CPU_CAPABILITY=avx2` after one without it gave NaN losses, and the other way
    round crashed. The switch is how this project shows the AVX2 class's numbers on an AVX-512
    machine (docs/testing.md), so each value gets its own cache."""
    capability = os.environ.get("ATEN_CPU_CAPABILITY")
    if not capability or _INDUCTOR_CACHE_AT_START is not None:
        return None
    try:
        user = re.sub(r"[^A-Za-z0-9_.-]", "_", getpass.getuser())
    except (KeyError, OSError):  # no name for this uid (a bare container)
        user = f"uid_{os.getuid()}" if hasattr(os, "getuid") else "user"
    folder = os.path.join(tempfile.gettempdir(), f"torchinductor_{user}_aten_{capability}")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = folder
    return folder


def compile_model(model: torch.nn.Module, backend: str = "inductor") -> tuple[torch.nn.Module, CountingBackend]:
    """(the compiled module, its counter). dynamic=True: batch shapes change every step."""
    inductor_cache_per_capability()
    counter = CountingBackend(backend)
    # Process-wide, set before the first call compiles: a training process compiles the model only.
    torch.fx.experimental._config.use_duck_shape = False
    return torch.compile(model, dynamic=True, backend=counter), counter


# ---------------------------------------------------------------------------------------------
# The worker's part


class WorkerDevice:
    """How this worker runs on `device`, set up once: torch threads, denormals and the CUDA device at
    construction, then the precision (`speed.precision`), its autocast and loss settings, the model
    compiled or not (`compile`) and the attention kernel (`choose_attention`)."""

    def __init__(self, speed: SpeedSection, device: torch.device, num_threads: int = 0):
        self.speed, self.device = speed, device
        use_threads(num_threads)  # Ray's OMP_NUM_THREADS may say otherwise
        if device.type == "cpu":
            torch.set_flush_denormal(True)  # denormals slow CPU matmuls many-fold late in training
        else:
            torch.cuda.set_device(device)
        self.precision = resolve_precision(speed.precision, device)
        self.autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.precision)
        self.row_multiple = row_multiple(self.precision, device)  # what `feeder.collate` rounds to
        self.attention: Callable[[], ContextManager] = contextlib.nullcontext  # the steps' SDPA kernel choice
        self.compiler: CountingBackend | None = None  # counts the graphs torch.compile made (speed.compile)

    def autocast_context(self) -> Callable[[], ContextManager]:
        """What makes the context a forward runs in: autocast to the precision's dtype (none in fp32)."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext
        return functools.partial(torch.autocast, self.device.type, dtype=self.autocast_dtype)

    def loss_settings(self, model: Any, label_smoothing: float, pad_id: int) -> LossSettings:
        """The steps' and the dev loss's `LossSettings` for `model` (a `model.Transformer`): fp16 (GPUs
        without bf16) scales the loss with the device's own GradScaler (tests drive it on the CPU);
        `speed.fused_loss` fuses the output projection with the loss, multiplying in the autocast dtype."""
        scaler = torch.amp.GradScaler(self.device.type) if self.precision == "fp16" else None
        fused = (FusedOutput(model.output_proj.weight, self.autocast_dtype or torch.float32)
                 if on_for(self.speed.fused_loss, self.device.type) else None)
        return LossSettings(label_smoothing=label_smoothing, pad_id=pad_id, autocast=self.autocast_context(), scaler=scaler,
                            fused_output=fused)

    def compile(self, model: torch.nn.Module) -> torch.nn.Module:
        """What the steps call: `model` compiled when `speed.compile` is on for this device (its graphs
        counted by `compiler`), else `model` itself."""
        if not on_for(self.speed.compile, self.device.type):
            return model
        compiled, self.compiler = compile_model(model, self.speed.compile_backend)
        return compiled

    def choose_attention(self, n_heads: int, head_dim: int) -> str:
        """Set `attention` (`speed.attention_backend`); a log line saying what was chosen and why."""
        self.attention, why = attention_context(self.speed.attention_backend, self.device, n_heads, head_dim,
                                                self.autocast_dtype or torch.float32)
        return why
