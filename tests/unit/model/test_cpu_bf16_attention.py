"""Under bf16 autocast on CPU, attention that needs gradients runs in fp32 (torch's bf16 CPU
flash-attention backward is several times slower): same result as SDPA on the fp32-upcast inputs."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from model import ModelConfig, Transformer
from model.compute import sdpa


def test_bf16_attention_with_grad_equals_fp32_sdpa_of_the_upcast_inputs():
    torch.manual_seed(0)
    q, k, v = (torch.randn(3, 2, 7, 8).to(torch.bfloat16).requires_grad_() for _ in range(3))
    mask = torch.rand(3, 1, 1, 7) > 0.2
    mask[..., 0] = True
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = sdpa(q, k, v, attn_mask=mask)
    assert y.dtype == torch.bfloat16
    ref_in = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*ref_in, attn_mask=mask)  # outside autocast: fp32
    assert torch.equal(y, ref.to(torch.bfloat16))
    g = torch.randn_like(ref)
    y.backward(g.to(torch.bfloat16))
    ref.backward(g.to(torch.bfloat16).float())
    for got, want in zip((q, k, v), ref_in):
        assert torch.allclose(got.grad.float(), want.grad, rtol=1e-2, atol=1e-2)


def test_without_grad_bf16_attention_stays_bf16():
    q = torch.randn(2, 2, 5, 8, dtype=torch.bfloat16)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(sdpa(q, q, q, is_causal=True), F.scaled_dot_product_attention(q, q, q, is_causal=True))


def test_a_bf16_training_step_of_the_model_runs_and_gives_fp32_master_grads():
    mc = ModelConfig(vocab_size=40, d_model=16, d_ff=32, n_heads=2, n_encoder_layers=1, n_decoder_layers=1)
    model = Transformer(mc)
    src = torch.randint(4, 40, (3, 6))
    tgt = torch.randint(4, 40, (3, 5))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model.logits(model(src, tgt))
    logits.float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())
