"""speed.precision: "auto" picks bf16 where the device does it natively, fp32 otherwise; "bf16" on a
CPU without it is an error naming the key; a bf16 CPU run is really autocast (its losses differ
from fp32's by rounding only)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipeline.config import Config, ConfigError
from pipeline.train import device as worker_device
from pipeline.train import feeder
from pipeline.train.loop import LocalSession, train_worker
from pipeline.train.device import describe, resolve_precision
from tests.support.synthetic import write_reverse_task
from tests.unit.train.test_loop import VOCAB, one_thread, tiny_spec  # noqa: F401 (fixture)

CPU = torch.device("cpu")


def _cpu(monkeypatch, avx512_bf16: bool, amx: bool) -> None:
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)


@pytest.mark.parametrize("avx512_bf16, amx", [(True, False), (False, True), (True, True)])
def test_auto_and_bf16_give_bf16_on_a_cpu_with_native_bf16(monkeypatch, avx512_bf16, amx):
    _cpu(monkeypatch, avx512_bf16, amx)
    assert resolve_precision("auto", CPU) == "bf16"
    assert resolve_precision("bf16", CPU) == "bf16"
    assert resolve_precision("fp32", CPU) == "fp32"
    assert "-> bf16 (CPU with " in describe("auto", CPU)


def test_cpu_without_native_bf16(monkeypatch):
    _cpu(monkeypatch, False, False)
    assert resolve_precision("auto", CPU) == "fp32"
    assert describe("auto", CPU) == "speed.precision=auto -> fp32 (CPU without native bf16)"
    with pytest.raises(ConfigError, match=r"speed\.precision = 'bf16' but this CPU has no native bf16"):
        resolve_precision("bf16", CPU)
    with pytest.raises(ConfigError, match=r"speed\.precision"):
        describe("bf16", CPU)  # what the train stage's driver calls before any worker starts


def test_fp16_on_cpu_and_unknown_values_are_errors():
    with pytest.raises(ConfigError, match=r"speed\.precision = 'fp16'"):
        resolve_precision("fp16", CPU)
    with pytest.raises(ConfigError, match=r"speed\.precision = 'fp8'"):
        resolve_precision("fp8", CPU)


def test_auto_is_the_default_and_validated():
    assert Config().speed.precision == "auto"
    cfg = Config()
    cfg.speed.precision = "bf17"
    with pytest.raises(ConfigError, match=r"speed\.precision"):
        cfg.validate()


def test_probes_agree_with_the_kernels_cpu_flags():
    """torch's probes vs /proc/cpuinfo (the kernel's view, an independent reference)."""
    info = Path("/proc/cpuinfo")
    assert info.exists(), "this test reads the Linux kernel's CPU flags"
    flags = {f for line in info.read_text().splitlines() if line.startswith("flags") for f in line.split()}
    expected = [n for n, f in (("AVX512-BF16", "avx512_bf16"), ("AMX", "amx_tile")) if f in flags]
    assert worker_device.cpu_bf16_features() == expected


@pytest.mark.slow
def test_a_bf16_cpu_run_is_autocast_and_tracks_fp32(tmp_path, monkeypatch):
    _cpu(monkeypatch, True, False)  # as on a bf16 CPU (emulated elsewhere: slower, same numbers)
    multiples: list[int] = []  # what the loop asks collate for: rows rounded to 64 in bf16 only
    collate = feeder.collate
    monkeypatch.setattr(feeder, "collate", lambda rows, data, layout: multiples.append(layout.row_multiple)
                        or collate(rows, data, layout))
    shards = (write_reverse_task(tmp_path / "train", 300, VOCAB, seed=0),
              write_reverse_task(tmp_path / "dev", 40, VOCAB, seed=1))
    linear_out: list[torch.dtype] = []  # what every nn.Linear of the model returned (PyTorch's global hook)
    hook = torch.nn.modules.module.register_module_forward_hook(
        lambda module, args, out: linear_out.append(out.dtype) if isinstance(module, torch.nn.Linear) else None)
    try:
        fp32 = train_worker(tiny_spec(shards, max_steps=6), LocalSession(tmp_path / "a"))
        assert set(multiples) == {1} and set(linear_out) == {torch.float32}
        multiples.clear()
        linear_out.clear()
        auto = train_worker(tiny_spec(shards, max_steps=6, speed_precision="auto"), LocalSession(tmp_path / "b"))
    finally:
        hook.remove()
    assert fp32["precision"] == "fp32" and auto["precision"] == "bf16"
    assert set(linear_out) == {torch.bfloat16}  # every projection of the model ran under autocast
    assert multiples.count(64) >= 6  # every training micro-batch (validation keeps its whole batches)
    a, b = [h[1] for h in fp32["history_train"]], [h[1] for h in auto["history_train"]]
    assert a != b  # bf16 matmuls round differently: autocast is on
    assert max(abs(x - y) / x for x, y in zip(a, b)) < 0.02  # but only by rounding


def test_only_bf16_on_a_cpu_rounds_the_rows():
    assert worker_device.row_multiple("bf16", CPU) == 64
    assert worker_device.row_multiple("fp32", CPU) == 1
    assert worker_device.row_multiple("bf16", torch.device("cuda")) == 1
