"""The output projection fused with the label-smoothed loss (model.training.linear_label_smoothed_nll)
against an independent fp64 reference: PyTorch's F.cross_entropy(label_smoothing=...) on the full
logits, with autograd's gradients; and the claim that it never holds a (tokens x vocabulary)
tensor, checked on every tensor the forward and backward create."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from model import linear_label_smoothed_nll

M, D, K, PAD = 300, 48, 1000, 0


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(M, D, generator=g, dtype=torch.float64) * 2
    weight = torch.randn(K, D, generator=g, dtype=torch.float64) * D ** -0.5
    target = torch.randint(1, K, (M,), generator=g)
    target[::7] = PAD  # pads are ignored
    return hidden, weight, target


def _reference(hidden, weight, target, eps):
    h, w = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    logits = h @ w.t()
    loss = F.cross_entropy(logits, target, label_smoothing=eps, ignore_index=PAD, reduction="sum")
    nll = F.cross_entropy(logits, target, ignore_index=PAD, reduction="sum")
    loss.backward()
    return loss.detach(), nll.detach(), h.grad, w.grad


@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_fp64_equals_pytorchs_loss_and_gradients(eps):
    hidden, weight, target = _inputs()
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss, nll = linear_label_smoothed_nll(h, w, target, eps, PAD, chunk_elements=37 * K)  # 8+ chunks, ragged
    loss.backward()
    ref_loss, ref_nll, ref_gh, ref_gw = _reference(hidden, weight, target, eps)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-9)
    torch.testing.assert_close(nll, ref_nll, rtol=1e-12, atol=1e-9)
    torch.testing.assert_close(h.grad, ref_gh, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(w.grad, ref_gw, rtol=1e-10, atol=1e-12)


def test_bf16_projection_is_within_bf16_tolerance_of_the_fp64_reference():
    hidden, weight, target = _inputs(1)
    h, w = hidden.float().requires_grad_(), weight.float().requires_grad_()  # fp32 masters, bf16 matmuls
    loss, nll = linear_label_smoothed_nll(h, w, target, 0.1, PAD, dtype=torch.bfloat16, chunk_elements=64 * K)
    loss.backward()
    ref_loss, ref_nll, ref_gh, ref_gw = _reference(hidden, weight, target, 0.1)
    assert loss.dtype == torch.float32 and h.grad.dtype == w.grad.dtype == torch.float32
    n = int((target != PAD).sum())
    assert abs(float(loss.detach()) - float(ref_loss)) / n < 0.02  # per token: bf16 logits carry ~3 digits
    assert abs(float(nll.detach()) - float(ref_nll)) / n < 0.02
    for got, ref in ((h.grad, ref_gh), (w.grad, ref_gw)):
        rel = float((got.double() - ref).norm() / ref.norm())
        assert rel < 0.02, rel


class _Largest(TorchDispatchMode):
    """Records the largest float32 tensor any op returns (numel), forward and backward."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.largest = max(self.largest, t.numel())
        return out


def test_no_tokens_by_vocabulary_tensor_is_ever_made():
    hidden, weight, target = _inputs(2)
    h, w = hidden.float().requires_grad_(), weight.float().requires_grad_()
    with _Largest() as fused:
        loss, _ = linear_label_smoothed_nll(h, w, target, 0.1, PAD, dtype=torch.bfloat16, chunk_elements=32 * K)
        loss.backward()
    with _Largest() as plain:  # the unfused path, for contrast: the fp32 logits of every row
        logits = h @ w.t()
        F.cross_entropy(logits, target, label_smoothing=0.1, ignore_index=PAD, reduction="sum").backward()
    assert plain.largest >= M * K
    assert fused.largest <= max(32 * K, K * D), fused.largest  # one chunk's logits, or the weight's gradient


@pytest.mark.parametrize("a, b", [(1.0, -1.0), (0.3, 2.0), (0.0, 1.0)], ids=["loss-nll", "mixed", "nll-only"])
def test_any_weighting_of_loss_and_nll_has_autograds_gradients(a, b):
    """The hand-written backwards weigh the softmax by each row's (loss + nll) weight and the gold
    term separately; any weighting, loss - nll included (a softmax weight of 0 with a gold term
    left), gives autograd's gradients in fp64: both losses, fused and on given logits."""
    from model import label_smoothed_nll

    hidden, weight, target = _inputs(3)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss, nll = linear_label_smoothed_nll(h, w, target, 0.1, PAD, chunk_elements=50 * K)
    (a * loss + b * nll).backward()
    hl = hidden.clone().requires_grad_()
    logits = hl @ weight.t()
    loss2, nll2 = label_smoothed_nll(logits, target, 0.1, PAD)
    (a * loss2 + b * nll2).backward()
    h_ref, w_ref = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref_logits = h_ref @ w_ref.t()
    ref = (a * F.cross_entropy(ref_logits, target, label_smoothing=0.1, ignore_index=PAD, reduction="sum")
           + b * F.cross_entropy(ref_logits, target, ignore_index=PAD, reduction="sum"))
    ref.backward()
    torch.testing.assert_close(h.grad, h_ref.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(w.grad, w_ref.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(hl.grad, h_ref.grad, rtol=1e-10, atol=1e-12)
