"""Label-smoothed cross-entropy (§5.4, Szegedy et al. 2016)."""

from __future__ import annotations

import torch


def _at_least_fp32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


class _SmoothedCrossEntropy(torch.autograd.Function):
    """Per-position (loss, nll) with a hand-written backward: one (M, K) pass for the softmax
    instead of autograd's chain through log_softmax, mean, gather and masking (each a full pass
    over M x K floats, the biggest tensor of a training step)."""

    @staticmethod
    def forward(ctx, logits, target, epsilon, ignore_index):  # (M, K), (M,) -> (M,), (M,)
        x = _at_least_fp32(logits)
        keep = target.ne(ignore_index)  # (M,)
        tgt = target.masked_fill(~keep, 0)
        lse = torch.logsumexp(x, dim=-1)  # (M,)
        nll = lse - x.gather(1, tgt[:, None])[:, 0]  # -log p(target)
        smooth = lse - x.mean(dim=-1)  # (1/K) sum_k -log p(k)
        loss = ((1.0 - epsilon) * nll + epsilon * smooth).masked_fill_(~keep, 0.0)
        ctx.save_for_backward(logits, lse, tgt, keep)
        ctx.epsilon = epsilon
        return loss, nll.masked_fill_(~keep, 0.0)

    @staticmethod
    def backward(ctx, grad_loss, grad_nll):
        # d loss_i / d x_ik = p_ik - (1 - eps) [k = t_i] - eps / K ;  d nll_i / d x_ik = p_ik - [k = t_i]
        logits, lse, tgt, keep = ctx.saved_tensors
        eps, K = ctx.epsilon, logits.shape[1]
        g_loss = grad_loss * keep  # (M,)
        g_nll = grad_nll * keep
        grad = (_at_least_fp32(logits) - lse[:, None]).exp_().mul_((g_loss + g_nll)[:, None])  # (M, K)
        grad.sub_((eps / K) * g_loss[:, None])
        grad.scatter_add_(1, tgt[:, None], -((1.0 - eps) * g_loss + g_nll)[:, None])
        return grad.to(logits.dtype), None, None, None


def label_smoothed_nll(logits: torch.Tensor, target: torch.Tensor, epsilon: float = 0.1,
                       ignore_index: int = 0, reduction: str = "sum") -> tuple[torch.Tensor, torch.Tensor]:
    """Label-smoothed loss and plain NLL of `target` under `logits`.

    logits (..., K), target (...) long. Returns (loss, nll):
        nll_i    = -log p(target_i)
        loss_i   = (1 - epsilon) * nll_i + (epsilon / K) * sum_k -log p(k)
    i.e. the target distribution puts 1 - epsilon on the gold token and spreads epsilon
    uniformly over all K classes (the gold one included), exactly as
    `F.cross_entropy(..., label_smoothing=epsilon)`.
    Deviation: tensor2tensor and fairseq spread epsilon over the K - 1 other classes (the paper,
    §5.4 eps_ls = 0.1, does not say) because this variant is testable against PyTorch; the gold
    token's target mass differs by epsilon / K, ~3e-6 at K = 37000.

    Positions where target == ignore_index (pad) contribute 0. reduction: "sum" (default; the
    trainer divides by the number of target tokens of a whole optimizer step), "mean" (over
    non-pad tokens) or "none" (per position, 0 at pads). Computed in float32 at least; both
    outputs are differentiable (the nll usually serves for logging: detach it).
    """
    if reduction not in ("sum", "mean", "none"):
        raise ValueError(f"reduction must be 'sum', 'mean' or 'none', got {reduction!r}")
    K = logits.shape[-1]
    loss, nll = _SmoothedCrossEntropy.apply(logits.reshape(-1, K), target.reshape(-1), float(epsilon),
                                            ignore_index)
    if reduction == "none":
        return loss.view(target.shape), nll.view(target.shape)
    if reduction == "sum":
        return loss.sum(), nll.sum()
    n_tokens = target.ne(ignore_index).sum().clamp(min=1)
    return loss.sum() / n_tokens, nll.sum() / n_tokens
