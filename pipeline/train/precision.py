"""`train.precision`: which autocast dtype a worker trains in, decided per device.

"auto" (the default) = bf16 autocast where the device does bf16 natively, fp32 otherwise:
- CUDA: bf16 when `torch.cuda.is_bf16_supported()` (Ampere and later), else fp16 with a
  GradScaler (what "bf16" has always fallen back to on such GPUs);
- CPU: bf16 when the CPU has AVX512-BF16 or AMX instructions (oneDNN's bf16 matmuls: a training
  step 1.4-1.6x faster at d_model 256, 1.17x on local mode's real batches; docs/benchmarks.md),
  else fp32.

"bf16" asked for on a CPU without those instructions is an error (emulated bf16 is slower than
fp32 there, and silently training in another precision than asked is worse); so is "fp16" on a
CPU. Imports torch only (no Ray, no MLflow): the GPU check runs it on a bare CUDA image.
"""

from __future__ import annotations

import logging
import typing
from pathlib import Path

import torch

from pipeline.config import ConfigError, Precision

log = logging.getLogger(__name__)

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
    """The precision a worker on `device` trains in ("bf16" | "fp16" | "fp32") for `train.precision`."""
    if requested not in CHOICES:
        raise ConfigError(f"train.precision = {requested!r}: must be one of {', '.join(CHOICES)}")
    if device.type == "cuda":
        if requested == "fp32":
            return "fp32"
        if requested in ("bf16", "auto") and not torch.cuda.is_bf16_supported():
            log.warning("train.precision=%s: this GPU has no bf16; using fp16 with a GradScaler", requested)
            return "fp16"
        return "bf16" if requested == "auto" else requested
    if requested == "fp32":
        return "fp32"
    features = cpu_bf16_features()
    if requested == "fp16":
        raise ConfigError("train.precision = 'fp16' is for GPUs without bf16; on a CPU use 'auto', 'bf16' "
                          "or 'fp32'")
    if requested == "bf16" and not features:
        raise ConfigError("train.precision = 'bf16' but this CPU has no native bf16 (neither AVX512-BF16 nor "
                          "AMX): emulated bf16 is slower than fp32; set train.precision = 'auto' or 'fp32'")
    return "bf16" if features else "fp32"


def row_multiple(precision: str, device: torch.device) -> int:
    """What a training micro-batch's computed positions are rounded up to (`token_batches.collate`):
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
    return f"train.precision={requested} -> {chosen} ({why})"
