"""`train.attention_backend`: which scaled-dot-product-attention kernel a GPU worker trains with.

PyTorch picks an SDPA backend by rule, not by speed; on Hopper with torch 2.11 it picks cuDNN's,
which builds a plan per shape (docs/benchmarks.md has the profile). "auto"
times each candidate (flash, memory-efficient, cuDNN) first in PyTorch's priority list, on what a
layer's attention does (one causal, two key-padding-masked calls, forward and backward) at a
training-sized shape of this model, and keeps the fastest for the run; a named backend is put
first as it is. The others stay behind it, so a call the chosen kernel cannot run (flash takes no
mask) falls back instead of failing. On a CPU "auto" leaves PyTorch's choice (its flash kernel; the model
already runs bf16 attention in fp32 there, `model.kernels.sdpa`). Torch only.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Callable, ContextManager

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

log = logging.getLogger(__name__)

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
        return (lambda: sdpa_kernel(backends, set_priority=True)), f"train.attention_backend = {setting} (first)"
    if device.type != "cuda":
        return contextlib.nullcontext, "train.attention_backend = auto: PyTorch's choice on a CPU"
    shape = (max(1, tokens // length), n_heads, length, head_dim)
    best, timings = fastest(GPU_CANDIDATES, shape, device, dtype)
    shown = ", ".join(f"{n} {t * 1e3:.2f} ms" if t != float("inf") else f"{n} cannot run" for n, t in timings.items())
    if best is None:
        return contextlib.nullcontext, f"train.attention_backend = auto: none of {shown}; PyTorch's choice"
    backends = priority(best)
    return ((lambda: sdpa_kernel(backends, set_priority=True)),
            f"train.attention_backend = auto -> {best} first (a layer's three attentions, fwd+bwd at {shape}: {shown})")
