"""Settings decided per device (pipeline/config/devices.py, pipeline/train/device.py) and the
GPU defaults of the loop exercised on this CPU: "auto" devices, the attention backend's choice,
and the fused output projection + loss trained against the plain one."""

from __future__ import annotations

import contextlib
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pipeline.config import ConfigError, load_config
from pipeline.config.devices import on_for, use_gpus
from pipeline.train import device as worker_device
from pipeline.train.loop import LocalSession, Trainer, LoopSpec, train_worker
from tests.unit.train.test_loop import shards, tiny_spec  # noqa: F401 (a fixture)


def test_use_gpus_auto_true_false():
    assert use_gpus("auto", 1, "workers.use_gpu") and not use_gpus("auto", 0, "workers.use_gpu")
    assert use_gpus(True, 8, "decode.use_gpu") and not use_gpus(False, 8, "decode.use_gpu")
    with pytest.raises(ConfigError, match=r"decode.use_gpu = true but the Ray cluster has no GPU.*\"auto\""):
        use_gpus(True, 0, "decode.use_gpu")


def test_on_for_is_on_for_cuda_only_when_auto():
    assert on_for("auto", "cuda") and not on_for("auto", "cpu")
    assert on_for(True, "cpu") and not on_for(False, "cuda")


def test_config_takes_auto_or_a_boolean_and_names_the_key_otherwise():
    cfg = load_config(None, ["--workers.use_gpu=auto", "--decode.use_gpu=false", "--speed.compile=true"])
    assert (cfg.workers.use_gpu, cfg.decode.use_gpu, cfg.speed.compile, cfg.speed.shape_buckets) == ("auto", False, True,
                                                                                                  "auto")
    with pytest.raises(ConfigError, match="speed.shape_buckets"):
        load_config(None, ["--speed.shape_buckets=sometimes"])
    with pytest.raises(ConfigError, match="speed.attention_backend"):
        load_config(None, ["--speed.attention_backend=fastest"])


def test_attention_context_on_a_cpu():
    make, why = worker_device.attention_context("auto", torch.device("cpu"), 4, 32, torch.float32)
    assert make is contextlib.nullcontext and "CPU" in why
    make, why = worker_device.attention_context("math", torch.device("cpu"), 4, 32, torch.float32)
    q = torch.randn(2, 4, 8, 16)
    with make():  # only the math kernel allowed: the result is still attention
        out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, q, q, is_causal=True))
    # cuDNN first cannot run on a CPU: the call falls back to the next in the list instead of failing
    # (as flash, which takes no padding mask, falls back for the encoder's and the cross-attention's calls).
    mask = torch.tensor([[True] * 6 + [False] * 2, [True] * 8])[:, None, None, :]
    with worker_device.attention_context("cudnn", torch.device("cpu"), 4, 32, torch.float32)[0]():
        masked = F.scaled_dot_product_attention(q, q, q, attn_mask=mask)
    torch.testing.assert_close(masked, F.scaled_dot_product_attention(q, q, q, attn_mask=mask))
    assert worker_device.priority("flash")[0] == torch.nn.attention.SDPBackend.FLASH_ATTENTION
    assert worker_device.priority("flash")[-1] == torch.nn.attention.SDPBackend.MATH and len(worker_device.priority("math")) == 4


def test_fastest_times_each_backend_first_with_its_fallbacks():
    best, timings = worker_device.fastest(("math", "flash", "cudnn"), (4, 2, 16, 8), torch.device("cpu"), torch.float32)
    assert set(timings) == {"math", "flash", "cudnn"} and all(t < float("inf") for t in timings.values())
    assert timings[best] == min(timings.values())


def test_the_fused_loss_trains_as_the_plain_projection(shards, tmp_path):  # noqa: F811
    def run(name, fused):
        return train_worker(tiny_spec(shards, max_steps=6, speed_fused_loss=fused), LocalSession(tmp_path / name))
    plain, fused = run("plain", False), run("fused", True)
    np.testing.assert_allclose([h[1] for h in fused["history_train"]], [h[1] for h in plain["history_train"]],
                               rtol=1e-5)


def test_auto_settings_stay_off_on_a_cpu(shards, tmp_path):  # noqa: F811
    trainer = Trainer(LoopSpec(**tiny_spec(shards)), LocalSession(tmp_path))
    assert trainer.speed.compile == trainer.speed.shape_buckets == trainer.speed.fused_loss == "auto"
    assert trainer.device_setup.compiler is None and trainer.loss_settings.fused_output is None


def test_a_capability_set_by_hand_compiles_into_an_inductor_cache_of_its_own(monkeypatch, tmp_path):
    """Inductor loads CPU code cached under another `ATEN_CPU_CAPABILITY` (NaN losses, or a crash):
    each value set by hand gets its own cache folder, before the model is compiled."""
    monkeypatch.setattr(worker_device.tempfile, "gettempdir", lambda: str(tmp_path))
    monkeypatch.setattr(worker_device, "_INDUCTOR_CACHE_AT_START", None)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    assert worker_device.inductor_cache_per_capability() is None  # no switch: inductor's own default
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ

    folders = {}
    for capability in ("avx2", "default"):
        monkeypatch.setenv("ATEN_CPU_CAPABILITY", capability)
        # What inductor writes when it first looks for its cache (torch._dynamo.reset() does)
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "torchinductor_default"))
        worker_device.compile_model(torch.nn.Linear(2, 2), backend="eager")
        folders[capability] = os.environ["TORCHINDUCTOR_CACHE_DIR"]
        assert folders[capability].startswith(str(tmp_path)) and folders[capability].endswith(f"_aten_{capability}")
    assert folders["avx2"] != folders["default"]

    # A folder the process was started with is the user's choice: kept
    monkeypatch.setattr(worker_device, "_INDUCTOR_CACHE_AT_START", str(tmp_path / "mine"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert worker_device.inductor_cache_per_capability() is None
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")
