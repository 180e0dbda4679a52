"""The paper's §5, Training: Adam and its learning-rate schedule (§5.3), and the label-smoothed
cross-entropy (§5.4, Szegedy et al. 2016) that the step minimizes. Dropout, §5.4's other
regularizer, is a layer of the model (`model.compute.Dropout`)."""

from __future__ import annotations

from typing import Callable

import torch


# §5.3 Optimizer

ADAM_BETAS = (0.9, 0.98)  # §5.3: beta1 = 0.9, beta2 = 0.98
ADAM_EPS = 1e-9  # §5.3: epsilon = 1e-9


def noam_lr(step: int, d_model: int = 512, warmup_steps: int = 4000, scale: float = 1.0) -> float:
    """§5.3: lrate = scale * d_model^-0.5 * min(step^-0.5, step * warmup_steps^-1.5).

    `step` counts optimizer steps from 1 (the first update uses step=1); step < 1 raises
    ValueError, because the formula is 0 (or undefined) there and a silent 0 hides an
    off-by-one. Peaks at step = warmup_steps: 6.99e-4 for d_model 512, warmup 4000.
    """
    if step < 1:
        raise ValueError(f"noam_lr: step counts from 1, got {step}")
    return scale * d_model ** -0.5 * min(step ** -0.5, step * warmup_steps ** -1.5)


def noam_lambda(d_model: int = 512, warmup_steps: int = 4000, scale: float = 1.0) -> Callable[[int], float]:
    """Multiplier for `torch.optim.lr_scheduler.LambdaLR` on an optimizer with lr = 1.0.

    LambdaLR calls it with the number of `scheduler.step()` calls so far, starting at 0 when it
    is built; with `optimizer.step(); scheduler.step()` per update, update k (from 1) runs with
    lambda(k - 1) = noam_lr(k).
    """
    def lr_lambda(epoch: int) -> float:
        return noam_lr(epoch + 1, d_model, warmup_steps, scale)

    return lr_lambda


def make_optimizer(model: torch.nn.Module, betas: tuple[float, float] = ADAM_BETAS, eps: float = ADAM_EPS,
                   lr: float = 1.0, fused: bool | None = None) -> torch.optim.Adam:
    """Adam (§5.3), no weight decay, lr = 1.0 so that `LambdaLR(opt, noam_lambda(...))` sets the
    actual rate. Shared (tied) parameters appear once in `model.parameters()`.

    fused=None picks PyTorch's fused Adam kernel when every parameter is a floating-point
    tensor on cpu or cuda (same update, one kernel instead of ~10 passes; ~4x faster on CPU).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    if fused is None:
        fused = all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)
    return torch.optim.Adam(params, lr=lr, betas=betas, eps=eps, fused=fused)


def make_scheduler(optimizer: torch.optim.Optimizer, d_model: int = 512, warmup_steps: int = 4000,
                   scale: float = 1.0) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR with the §5.3 schedule; call `scheduler.step()` after every `optimizer.step()`."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, noam_lambda(d_model, warmup_steps, scale))


# §5.4 Regularization: label smoothing

# On a CPU the (M, K) logits are walked in row chunks of about this many elements by default: each
# chunk's fp32 copy and its softmax stay in cache, and bf16 logits are never copied whole to fp32;
# the values are the same bit for bit, faster (docs/benchmarks.md, `cpu_step_bench.py`). On a GPU
# one chunk: no Python loop.
CPU_CHUNK_ELEMENTS = 1 << 19


def _acc_dtype(logits: torch.Tensor) -> torch.dtype:
    return logits.dtype if logits.dtype in (torch.float32, torch.float64) else torch.float32


def _rows_per_chunk(logits: torch.Tensor, cpu_chunk_elements: int) -> int:
    M, K = logits.shape
    return M if logits.device.type != "cpu" else max(1, cpu_chunk_elements // max(K, 1))


class _SmoothedCrossEntropy(torch.autograd.Function):
    """Per-position (loss, nll) with a hand-written backward: one (M, K) pass for the softmax
    instead of autograd's chain through log_softmax, mean, gather and masking (each a full pass
    over M x K floats, the biggest tensor of a training step). Computed in fp32 at least, in row
    chunks of `rows` on a CPU."""

    @staticmethod
    def forward(ctx, logits, target, epsilon, ignore_index, rows, overwrite):  # (M, K), (M,) -> (M,), (M,)
        keep = target.ne(ignore_index)  # (M,)
        tgt = target.masked_fill(~keep, 0)
        M, acc = logits.shape[0], _acc_dtype(logits)
        lse = logits.new_empty(M, dtype=acc)
        mean = logits.new_empty(M, dtype=acc)
        for s in range(0, M, rows):
            x = logits[s : s + rows].to(acc)
            torch.logsumexp(x, dim=-1, out=lse[s : s + rows])
            torch.mean(x, dim=-1, out=mean[s : s + rows])
        nll = lse - logits.gather(1, tgt[:, None])[:, 0].to(acc)  # -log p(target)
        smooth = lse - mean  # (1/K) sum_k -log p(k)
        loss = ((1.0 - epsilon) * nll + epsilon * smooth).masked_fill_(~keep, 0.0)
        ctx.save_for_backward(logits, lse, tgt, keep)
        ctx.epsilon, ctx.rows, ctx.overwrite = epsilon, rows, overwrite and logits.dtype == acc
        return loss, nll.masked_fill_(~keep, 0.0)

    @staticmethod
    def backward(ctx, grad_loss, grad_nll):
        # d loss_i / d x_ik = p_ik - (1 - eps) [k = t_i] - eps / K ;  d nll_i / d x_ik = p_ik - [k = t_i]
        logits, lse, tgt, keep = ctx.saved_tensors
        eps, (M, K) = ctx.epsilon, logits.shape
        g_loss = grad_loss * keep  # (M,)
        g_nll = grad_nll * keep
        scale, uniform, gold = g_loss + g_nll, (eps / K) * g_loss, -((1.0 - eps) * g_loss + g_nll)
        lse, scale, uniform, tgt, gold = lse[:, None], scale[:, None], uniform[:, None], tgt[:, None], gold[:, None]

        def rows_grad(x: torch.Tensor, s: int, e: int) -> torch.Tensor:  # x: rows s:e of the logits, fp32+
            x.sub_(lse[s:e]).exp_().mul_(scale[s:e]).sub_(uniform[s:e])
            return x.scatter_add_(1, tgt[s:e], gold[s:e])

        rows = ctx.rows
        if ctx.overwrite:  # the logits' own memory becomes their gradient: no second (M, K) buffer
            for s in range(0, M, rows):
                rows_grad(logits[s : s + rows], s, s + rows)
            return logits, None, None, None, None, None
        if rows >= M:  # one chunk (a GPU): one fp32 copy
            return rows_grad(logits.to(lse.dtype, copy=True), 0, M).to(logits.dtype), None, None, None, None, None
        grad = torch.empty_like(logits)
        for s in range(0, M, rows):  # each chunk's fp32 copy stays in cache
            grad[s : s + rows] = rows_grad(logits[s : s + rows].to(lse.dtype, copy=True), s, s + rows)
        return grad, None, None, None, None, None


def label_smoothed_nll(logits: torch.Tensor, target: torch.Tensor, epsilon: float = 0.1,
                       ignore_index: int = 0, reduction: str = "sum",
                       cpu_chunk_elements: int = CPU_CHUNK_ELEMENTS, overwrite_logits: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor]:
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
    outputs are differentiable (the nll usually serves for logging: detach it). On a CPU the
    logits are walked in rows of about `cpu_chunk_elements` elements (the same values; see
    `CPU_CHUNK_ELEMENTS`). `overwrite_logits`: fp32 logits that nobody reads after the loss (a
    training step's) become their own gradient in backward, in place: no second (M, K) buffer, whose
    fresh pages cost the CPU as much as the arithmetic on them (docs/benchmarks.md).
    """
    if reduction not in ("sum", "mean", "none"):
        raise ValueError(f"reduction must be 'sum', 'mean' or 'none', got {reduction!r}")
    K = logits.shape[-1]
    logits = logits.reshape(-1, K)
    loss, nll = _SmoothedCrossEntropy.apply(logits, target.reshape(-1), float(epsilon), ignore_index,
                                            _rows_per_chunk(logits, cpu_chunk_elements), overwrite_logits)
    if reduction == "none":
        return loss.view(target.shape), nll.view(target.shape)
    if reduction == "sum":
        return loss.sum(), nll.sum()
    n_tokens = target.ne(ignore_index).sum().clamp(min=1)
    return loss.sum() / n_tokens, nll.sum() / n_tokens


# On a GPU the fused loss walks the rows in chunks of about this many logits (256 MiB in fp32): at
# base's 25k target tokens x 37k pieces it holds ~7,000 rows' logits at a time instead of 3.7 GB.
GPU_CHUNK_ELEMENTS = 1 << 26


class _LinearSmoothedCrossEntropy(torch.autograd.Function):
    """`_SmoothedCrossEntropy` of `hidden @ weight.T`, fused with that projection (the fused linear
    cross-entropy of Liger Kernel and Apple's cut-cross-entropy, in plain torch): the (M, K) logits
    exist only `rows` at a time, the matmul in `dtype` (bf16 under autocast), the softmax in fp32.
    Forward keeps per row the log-sum-exp only; backward recomputes each chunk's logits and turns
    them into that chunk's gradient in place, then into the chunk's share of both gradients
    (the weight's accumulated in fp32)."""

    @staticmethod
    def forward(ctx, hidden, weight, target, epsilon, ignore_index, rows, dtype):  # (M, d), (K, d), (M,)
        keep = target.ne(ignore_index)
        tgt = target.masked_fill(~keep, 0)
        h, w = hidden.to(dtype), weight.to(dtype)
        acc = _acc_dtype(h)
        M = h.shape[0]
        lse, mean, gold = (h.new_empty(M, dtype=acc) for _ in range(3))
        for s in range(0, M, rows):
            x = (h[s : s + rows] @ w.t()).to(acc)  # (r, K): this chunk's logits, fp32 at least
            torch.logsumexp(x, dim=-1, out=lse[s : s + rows])
            torch.mean(x, dim=-1, out=mean[s : s + rows])
            gold[s : s + rows] = x.gather(1, tgt[s : s + rows, None])[:, 0]
        nll = lse - gold
        loss = ((1.0 - epsilon) * nll + epsilon * (lse - mean)).masked_fill_(~keep, 0.0)
        ctx.save_for_backward(h, w, lse, tgt, keep)
        ctx.epsilon, ctx.rows, ctx.dtypes = epsilon, rows, (hidden.dtype, weight.dtype)
        return loss, nll.masked_fill_(~keep, 0.0)

    @staticmethod
    def backward(ctx, grad_loss, grad_nll):
        h, w, lse, tgt, keep = ctx.saved_tensors
        eps, rows, (M, K) = ctx.epsilon, ctx.rows, (h.shape[0], w.shape[0])
        g_loss, g_nll = grad_loss * keep, grad_nll * keep
        scale, uniform, gold = g_loss + g_nll, (eps / K) * g_loss, -((1.0 - eps) * g_loss + g_nll)
        grad_h = torch.empty_like(h)
        grad_w = torch.zeros(w.shape, dtype=lse.dtype, device=w.device)
        for s in range(0, M, rows):
            e = min(s + rows, M)
            x = (h[s:e] @ w.t()).to(lse.dtype)  # (r, K), recomputed
            x.sub_(lse[s:e, None]).exp_().mul_(scale[s:e, None]).sub_(uniform[s:e, None])
            g = x.scatter_add_(1, tgt[s:e, None], gold[s:e, None]).to(h.dtype)  # d loss / d logits
            torch.mm(g, w, out=grad_h[s:e])
            grad_w += (g.t() @ h[s:e]).to(grad_w.dtype)
        hidden_dtype, weight_dtype = ctx.dtypes
        return grad_h.to(hidden_dtype), grad_w.to(weight_dtype), None, None, None, None, None


def linear_label_smoothed_nll(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                              epsilon: float = 0.1, ignore_index: int = 0, dtype: torch.dtype | None = None,
                              chunk_elements: int = GPU_CHUNK_ELEMENTS) -> tuple[torch.Tensor, torch.Tensor]:
    """`label_smoothed_nll(hidden @ weight.T, target, ...)` (sum reduction) without the (M, K)
    logits: hidden (M, d), weight (K, d) (the output projection, tied or not), target (M,).
    `dtype`: the projection's (bf16 under autocast; default hidden's); the softmax and the sums are
    fp32 at least. `chunk_elements`: logits held at a time (rows = chunk_elements // K)."""
    rows = max(1, chunk_elements // max(weight.shape[0], 1))
    loss, nll = _LinearSmoothedCrossEntropy.apply(hidden, weight, target, float(epsilon), ignore_index, rows,
                                                  dtype or hidden.dtype)
    return loss.sum(), nll.sum()
