"""Checkpoint averaging (§6.1: the last 5 or 20 checkpoints, written every 10 minutes)."""

from __future__ import annotations

import torch


def average_checkpoints(state_dicts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Element-wise mean of model state dicts.

    Floating-point tensors are summed in float64 and cast back to their own dtype. Integer and
    bool tensors (counters, index buffers) cannot be averaged: they must be equal in every
    input and are copied. Keys, shapes and dtypes must match across inputs; otherwise
    ValueError naming the key. Tensors are returned on the device of the first input.
    """
    if not state_dicts:
        raise ValueError("average_checkpoints: need at least one state dict")
    first = state_dicts[0]
    for i, sd in enumerate(state_dicts[1:], start=1):
        if set(sd) != set(first):
            diff = sorted(set(sd) ^ set(first))
            raise ValueError(f"average_checkpoints: state dict {i} has different keys: {', '.join(diff)}")
    averaged: dict[str, torch.Tensor] = {}
    shared: dict[tuple[int, int, tuple[int, ...]], str] = {}  # keys of one tied tensor stay tied
    for key, ref in first.items():
        if isinstance(ref, torch.Tensor):
            ident = _ident(ref)
            tied_to = shared.get(ident)
            if tied_to is not None and all(isinstance(sd[key], torch.Tensor) and _ident(sd[key]) == _ident(sd[tied_to])
                                           for sd in state_dicts):
                averaged[key] = averaged[tied_to]
                continue
            shared.setdefault(ident, key)
        tensors = [sd[key] for sd in state_dicts]
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"average_checkpoints: {key} is a {type(t).__name__}, not a tensor")
            if t.shape != ref.shape or t.dtype != ref.dtype:
                raise ValueError(f"average_checkpoints: {key} has shape/dtype {tuple(t.shape)}/{t.dtype}, "
                                 f"expected {tuple(ref.shape)}/{ref.dtype}")
        if ref.is_floating_point() or ref.is_complex():
            acc = torch.zeros(ref.shape, dtype=torch.complex128 if ref.is_complex() else torch.float64,
                              device=ref.device)
            for t in tensors:
                acc += t.to(device=ref.device, dtype=acc.dtype)
            averaged[key] = (acc / len(tensors)).to(ref.dtype)
        else:
            if any(not torch.equal(t.to(ref.device), ref) for t in tensors[1:]):
                raise ValueError(f"average_checkpoints: integer tensor {key} differs between inputs")
            averaged[key] = ref.clone()
    return averaged


def _ident(t: torch.Tensor) -> tuple[int, int, tuple[int, ...]]:
    """Tensors with equal identities are one tensor under two keys (tied weights)."""
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
