"""Learning-rate schedule, optimizer settings, label smoothing, checkpoint averaging."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from model import (ADAM_BETAS, ADAM_EPS, ModelConfig, Transformer, average_checkpoints,
                   label_smoothed_nll, make_optimizer, make_scheduler, noam_lambda, noam_lr)



def test_noam_lr_formula():
    assert noam_lr(1) == pytest.approx(512 ** -0.5 * 1 * 4000 ** -1.5)
    assert noam_lr(4000) == pytest.approx(512 ** -0.5 * 4000 ** -0.5)
    assert noam_lr(4000) == pytest.approx(6.9877e-4, rel=1e-4)  # the peak
    assert noam_lr(100_000) == pytest.approx(512 ** -0.5 * 100_000 ** -0.5)
    assert noam_lr(3999) < noam_lr(4000) > noam_lr(4001)
    expected = 2 * 1024 ** -0.5 * 10 * 100 ** -1.5
    assert noam_lr(10, d_model=1024, warmup_steps=100, scale=2.0) == pytest.approx(expected)
    with pytest.raises(ValueError):
        noam_lr(0)


def test_lambda_lr_gives_noam_rate_per_optimizer_step():
    model = torch.nn.Linear(3, 2)
    opt = make_optimizer(model)
    assert opt.defaults["betas"] == ADAM_BETAS == (0.9, 0.98) and opt.defaults["eps"] == ADAM_EPS == 1e-9
    sched = torch.optim.lr_scheduler.LambdaLR(opt, noam_lambda(512, 4))
    seen = []
    for _ in range(6):
        seen.append(opt.param_groups[0]["lr"])  # the rate this update uses
        model(torch.ones(1, 3)).sum().backward()
        opt.step()
        sched.step()
    assert seen == pytest.approx([noam_lr(k, 512, 4) for k in range(1, 7)])
    assert make_scheduler(make_optimizer(model), 512, 4).get_last_lr()[0] == pytest.approx(noam_lr(1, 512, 4))


def test_label_smoothing_hand_computed():
    logits = torch.tensor([[2.0, 0.0, -1.0]])
    target = torch.tensor([0])
    z = math.log(math.exp(2.0) + 1.0 + math.exp(-1.0))
    nll = z - 2.0
    smooth = ((z - 2.0) + z + (z + 1.0)) / 3  # mean over the 3 classes of -log p
    loss, got_nll = label_smoothed_nll(logits, target, epsilon=0.1, ignore_index=-100)
    assert got_nll.item() == pytest.approx(nll)
    assert loss.item() == pytest.approx(0.9 * nll + 0.1 * smooth)


def test_label_smoothing_matches_torch_and_ignores_pad():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=g)
    target = torch.randint(1, 11, (3, 5), generator=g)
    target[1, 3:] = 0
    target[2, 1:] = 0
    loss, nll = label_smoothed_nll(logits, target, epsilon=0.1, ignore_index=0)
    flat_logits, flat_target = logits.view(-1, 11), target.view(-1)
    ref = F.cross_entropy(flat_logits, flat_target, ignore_index=0, label_smoothing=0.1, reduction="sum")
    ref_nll = F.cross_entropy(flat_logits, flat_target, ignore_index=0, reduction="sum")
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6)
    assert nll.item() == pytest.approx(ref_nll.item(), rel=1e-6)
    # Pad positions contribute nothing, whatever their logits.
    noisy = logits.clone()
    noisy[target == 0] = 100.0 * torch.randn(int((target == 0).sum()), 11, generator=g)
    assert label_smoothed_nll(noisy, target)[0].item() == pytest.approx(loss.item(), rel=1e-6)
    per_token, _ = label_smoothed_nll(logits, target, reduction="none")
    assert per_token.shape == target.shape and (per_token[target == 0] == 0).all()
    mean, _ = label_smoothed_nll(logits, target, reduction="mean")
    assert mean.item() == pytest.approx(loss.item() / int((target != 0).sum()), rel=1e-6)


def _tiny_state_dict(fill: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((2, 3), fill), "h": torch.full((2,), fill, dtype=torch.float16),
            "steps": torch.tensor([7, 8])}


def test_average_checkpoints_exact_mean():
    out = average_checkpoints([_tiny_state_dict(1.0), _tiny_state_dict(2.0), _tiny_state_dict(6.0)])
    assert torch.equal(out["w"], torch.full((2, 3), 3.0))
    assert out["h"].dtype == torch.float16 and torch.equal(out["h"], torch.full((2,), 3.0, dtype=torch.float16))
    assert torch.equal(out["steps"], torch.tensor([7, 8]))
    # float64 accumulation: 2^24 + 1 + 1 is not representable in float32 partial sums.
    sds = [{"w": torch.tensor([2.0 ** 24])}, {"w": torch.tensor([1.0])}, {"w": torch.tensor([1.0])}]
    assert average_checkpoints(sds)["w"].item() == 5592406.0


def test_average_checkpoints_rejects_mismatches():
    a = _tiny_state_dict(1.0)
    with pytest.raises(ValueError, match="extra"):
        average_checkpoints([a, {**a, "extra": torch.zeros(1)}])
    with pytest.raises(ValueError, match=r"\bw has shape"):
        average_checkpoints([a, {**a, "w": torch.zeros(3, 2)}])
    with pytest.raises(ValueError, match="steps"):
        average_checkpoints([a, {**a, "steps": torch.tensor([7, 9])}])
    with pytest.raises(ValueError):
        average_checkpoints([])


def test_average_real_model_state_dicts_loads_back():
    cfg = ModelConfig(vocab_size=13, d_model=8, d_ff=16, n_heads=2, n_encoder_layers=1, n_decoder_layers=1)
    models = [Transformer(cfg) for _ in range(2)]
    avg = average_checkpoints([m.state_dict() for m in models])
    target = Transformer(cfg)
    target.load_state_dict(avg)
    expected = (models[0].src_embed.weight + models[1].src_embed.weight) / 2
    assert (target.output_proj.weight - expected).abs().max() < 1e-7


@pytest.mark.parametrize("epsilon", [0.0, 0.1])
def test_label_smoothing_gradients_match_torch(epsilon):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 3, 7, generator=g, dtype=torch.float64, requires_grad=True)
    target = torch.randint(1, 7, (4, 3), generator=g)
    target[0, 1:] = 0
    loss, nll = label_smoothed_nll(logits, target, epsilon=epsilon)
    (loss + 0.5 * nll).backward()
    ours = logits.grad.clone()
    logits.grad = None
    flat = logits.view(-1, 7)
    ref = F.cross_entropy(flat, target.view(-1), ignore_index=0, label_smoothing=epsilon, reduction="sum") \
        + 0.5 * F.cross_entropy(flat, target.view(-1), ignore_index=0, reduction="sum")
    ref.backward()
    assert torch.allclose(ours, logits.grad, rtol=1e-10, atol=1e-12)
    assert (ours[0, 1:] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_label_smoothing_in_cpu_row_chunks_matches_torch(dtype):
    """On a CPU the loss walks the logits in row chunks (`cpu_chunk_elements`): with chunks
    of 3 rows over 10 (the last one short), loss, nll and gradients equal PyTorch's cross entropy;
    bf16 logits to bf16 rounding of the gradient (the reference runs on the same values in fp64)."""
    g = torch.Generator().manual_seed(2)
    logits = (3 * torch.randn(10, 7, generator=g, dtype=torch.float64)).to(dtype).requires_grad_()
    target = torch.randint(1, 7, (10,), generator=g)
    target[[2, 9]] = 0
    loss, nll = label_smoothed_nll(logits, target, epsilon=0.1, cpu_chunk_elements=3 * 7)
    (loss + 0.5 * nll).backward()
    ref_logits = logits.detach().double().requires_grad_()
    ref_loss = F.cross_entropy(ref_logits, target, ignore_index=0, label_smoothing=0.1, reduction="sum")
    ref_nll = F.cross_entropy(ref_logits, target, ignore_index=0, reduction="sum")
    (ref_loss + 0.5 * ref_nll).backward()
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    assert loss.item() == pytest.approx(ref_loss.item(), rel=tol) and nll.item() == pytest.approx(ref_nll.item(), rel=tol)
    assert logits.grad.dtype == dtype
    atol = 1e-12 if dtype == torch.float64 else 2 ** -8 * ref_logits.grad.abs().max().item()
    assert torch.allclose(logits.grad.double(), ref_logits.grad, rtol=0, atol=atol)
    assert (logits.grad[[2, 9]] == 0).all()


@pytest.mark.parametrize("chunk_rows", [3, 10])
def test_overwritten_logits_give_pytorchs_gradients_in_their_own_memory(chunk_rows):
    """`overwrite_logits`: the fp32 logits of a projection (as in a training step) become their own
    gradient; what reaches the projection's inputs equals PyTorch's cross entropy through the same
    projection, and no second (M, K) buffer is made (the gradient's storage is the logits')."""
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(10, 5, generator=g, requires_grad=True)
    weight = torch.randn(7, 5, generator=g, requires_grad=True)
    target = torch.randint(1, 7, (10,), generator=g)
    target[[1, 6]] = 0
    seen = []
    logits = hidden @ weight.t()
    logits.register_hook(lambda grad: seen.append(grad.data_ptr() == logits.data_ptr()))
    loss, nll = label_smoothed_nll(logits, target, epsilon=0.1, cpu_chunk_elements=chunk_rows * 7, overwrite_logits=True)
    (loss + 0.5 * nll).backward()
    ours = hidden.grad.clone(), weight.grad.clone()
    ref_h, ref_w = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    ref_logits = ref_h @ ref_w.t()
    (F.cross_entropy(ref_logits, target, ignore_index=0, label_smoothing=0.1, reduction="sum")
     + 0.5 * F.cross_entropy(ref_logits, target, ignore_index=0, reduction="sum")).backward()
    assert seen == [True]
    assert loss.item() == pytest.approx(F.cross_entropy(ref_logits.detach(), target, ignore_index=0, label_smoothing=0.1,
                                                        reduction="sum").item(), rel=1e-5)
    assert torch.allclose(ours[0].double(), ref_h.grad, atol=1e-5) and torch.allclose(ours[1].double(), ref_w.grad, atol=1e-5)
