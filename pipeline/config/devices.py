"""Settings decided per device: `"auto"` and its booleans (`workers.use_gpu`, `decode.use_gpu`,
`speed.compile`, `speed.shape_buckets`). Standard library and the config only: no Ray, no torch."""

from __future__ import annotations

from .checks import ConfigError


def use_gpus(setting: bool | str, cluster_gpus: float, key: str) -> bool:
    """Whether a stage runs on GPUs: "auto" = when the cluster has one; true = it must have one
    (a ConfigError naming `key` before anything starts, instead of hours on CPUs nobody asked for);
    false = never."""
    has = cluster_gpus >= 1
    if setting == "auto":
        return has
    if setting and not has:
        raise ConfigError(f"{key} = true but the Ray cluster has no GPU; set {key} = \"auto\" to use a GPU when "
                          f"there is one and the CPUs otherwise, or false")
    return bool(setting)


def on_for(setting: bool | str, device_type: str) -> bool:
    """A per-device switch: "auto" = on for a CUDA device, off on a CPU; else the boolean."""
    return device_type == "cuda" if setting == "auto" else bool(setting)
