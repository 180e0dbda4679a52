"""The CPU dropout of `model.compute.Dropout` (four 15-bit uniforms per 64-bit draw): what it
keeps, how it scales, its gradient, and where it is used instead of PyTorch's."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from model import ModelConfig, Transformer
from model.compute import Dropout


@pytest.mark.parametrize("p", [0.1, 0.3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_keeps_1_minus_p_in_every_lane_and_scales_the_kept_values(p, dtype):
    torch.manual_seed(0)
    drop = Dropout(p).train()
    x = torch.rand(1000, 4000, dtype=dtype) + 0.5
    y = drop(x)
    kept = y != 0
    n = kept.numel()
    p_eff = round(p * 32768) / 32768
    sd = math.sqrt(p_eff * (1 - p_eff) / n)
    assert abs(kept.float().mean().item() - (1 - p_eff)) < 5 * sd
    # each of the four int16 lanes of a 64-bit draw (the top one has only 15 random bits)
    for lane in range(4):
        frac = kept.view(-1, 4)[:, lane].float().mean().item()
        assert abs(frac - (1 - p_eff)) < 5 * 2 * sd, lane
    # kept values are x / (1 - p): the expectation is x's (PyTorch's F.dropout scales the same way)
    ref = x.float()[kept] / (1 - p_eff)
    assert torch.allclose(y.float()[kept], ref, rtol=1e-6 if dtype == torch.float32 else 2 ** -8, atol=0)
    assert y.dtype == dtype


def test_gradient_is_the_mask_times_the_scale_and_seeds_repeat():
    x = torch.randn(64, 96, requires_grad=True)
    torch.manual_seed(5)
    y = Dropout(0.3).train()(x)
    g = torch.randn_like(y)
    y.backward(g)
    kept = (y != 0).float()
    scale = 1 / (1 - round(0.3 * 32768) / 32768)
    assert torch.allclose(x.grad, g * kept * scale)
    torch.manual_seed(5)
    assert torch.equal(Dropout(0.3).train()(x), y)  # the default generator's seed decides the mask
    assert not torch.equal(Dropout(0.3).train()(x), y)


def test_eval_mode_p0_and_the_switch_use_the_identity_or_pytorch():
    x = torch.randn(32, 48)
    assert torch.equal(Dropout(0.3).eval()(x), x)
    assert torch.equal(Dropout(0.0).train()(x), x)
    torch.manual_seed(1)
    ours = Dropout(0.3).train()(x)
    torch.manual_seed(1)
    theirs = F.dropout(x, 0.3, training=True)
    assert not torch.equal(ours, theirs)  # different masks (a different draw), the same kind of output
    torch.manual_seed(1)
    assert torch.equal(Dropout(0.3, cpu_kernel=False).train()(x), theirs)


def test_the_model_drops_with_it_and_a_training_step_learns():
    cfg = ModelConfig(vocab_size=40, d_model=32, d_ff=64, n_heads=2, n_encoder_layers=1, n_decoder_layers=1,
                      dropout=0.3)
    m = Transformer(cfg).train()
    drops = [mod for mod in m.modules() if isinstance(mod, torch.nn.Dropout)]
    assert drops and all(isinstance(d, Dropout) for d in drops)
    src = torch.randint(4, 40, (4, 7))
    tgt = torch.randint(4, 40, (4, 6))
    torch.manual_seed(0)
    a = m(src, tgt)
    torch.manual_seed(0)
    assert torch.equal(m(src, tgt), a)  # training forward repeats under a seed
    assert not torch.equal(m.eval()(src, tgt), a)


def test_the_cpu_kernels_option_reaches_every_dropout():
    cfg = ModelConfig(vocab_size=40, d_model=32, d_ff=64, n_heads=2, n_encoder_layers=1, n_decoder_layers=1,
                      dropout=0.3)
    for on in (True, False):
        drops = [mod for mod in Transformer(cfg, cpu_kernels=on).modules() if isinstance(mod, Dropout)]
        assert len(drops) == 3 and all(d.cpu_kernel is on for d in drops)
    x = torch.randn(4, 7, 32)
    plain = Transformer(cfg, cpu_kernels=False).train()
    torch.manual_seed(3)
    ours = plain.dropout(x)
    torch.manual_seed(3)
    assert torch.equal(ours, F.dropout(x, 0.3, training=True))  # PyTorch's masks
