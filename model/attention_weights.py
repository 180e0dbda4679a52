"""What a trained model attends to: the attention weights softmax(Q K^T / sqrt(d_k)) (§3.2.1) of
every layer and head, for one sentence pair, as the paper draws them (Figures 3-5).

The model's forward pass never materializes these weights (it calls
``F.scaled_dot_product_attention``, which returns only the weighted values). Every attention call
of the model first hands its queries, keys, mask and scale to `observe`; within
`recording_attention` (thread-local) they go to a callback. ``attention_weights`` runs one
teacher-forced forward pass of a sentence pair with such a callback, which computes each call's
weights; the pass's own outputs are unchanged. One sentence at a time, so no padding enters any
row. Torch only.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator, Sequence

import torch

KINDS = ("encoder_self", "decoder_self", "cross")

_RECORDER = threading.local()  # this thread's `recording_attention` callback, if any


@contextlib.contextmanager
def recording_attention(record: Callable[..., None]) -> Iterator[None]:
    """Within it, every attention call of this thread first calls record(q, k, attn_mask,
    is_causal, scale). Thread-local: a server decoding other requests with the same model in
    other threads is neither seen nor disturbed."""
    _RECORDER.record = record
    try:
        yield
    finally:
        _RECORDER.record = None


def observe(q: torch.Tensor, k: torch.Tensor, attn_mask: torch.Tensor | None, is_causal: bool,
            scale: float | None) -> None:
    """Called by the model's attention before it attends: passes the call to this thread's
    `recording_attention` callback, if any (never while torch.compile traces)."""
    if not torch.compiler.is_compiling() and getattr(_RECORDER, "record", None) is not None:
        _RECORDER.record(q, k, attn_mask, is_causal, scale)


def _weights(q: torch.Tensor, k: torch.Tensor, attn_mask: torch.Tensor | None, is_causal: bool,
             scale: float | None) -> torch.Tensor:
    """(B, h, Tq, hs), (B, h, Tk, hs) -> (B, h, Tq, Tk): SDPA's softmax, explicitly (fp32)."""
    q, k = q.float(), k.float()
    scores = q @ k.transpose(-2, -1) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if is_causal:
        tq, tk = scores.shape[-2:]
        scores = scores.masked_fill(~torch.ones(tq, tk, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf"))
    return scores.softmax(-1)


@torch.no_grad()
def attention_weights(model: torch.nn.Module, src_ids: Sequence[int], tgt_in_ids: Sequence[int]
                      ) -> dict[str, torch.Tensor]:
    """One pair through `model` (a `Transformer`): ``src_ids`` = pieces + [eos], ``tgt_in_ids`` =
    [bos] + pieces (e.g. the model's own translation). Returns {"encoder_self": (L_enc, h, S, S),
    "decoder_self": (L_dec, h, T, T), "cross": (L_dec, h, T, S)}: row i of a map is query position
    i's distribution over the keys.

    The pass calls attention in a fixed order (every encoder layer's, then each decoder layer's
    self- and cross-attention), recorded for this thread only (`recording_attention`): a server
    may decode other requests with the same model meanwhile."""
    calls: list[torch.Tensor] = []

    def record(q, k, attn_mask, is_causal, scale):
        calls.append(_weights(q, k, attn_mask, is_causal, scale)[0])  # (h, Tq, Tk)

    was_training = model.training  # no dropout in the pass (a served model is in eval mode already)
    model.eval()
    device = next(model.parameters()).device
    try:
        with recording_attention(record):
            model(torch.tensor([list(src_ids)], device=device), torch.tensor([list(tgt_in_ids)], device=device))
    finally:
        model.train(was_training)
    n_enc, n_dec = len(model.encoder_layers), len(model.decoder_layers)
    if len(calls) != n_enc + 2 * n_dec:
        raise RuntimeError(f"attention_weights: {len(calls)} attention calls, expected {n_enc + 2 * n_dec}")
    found = {"encoder_self": calls[:n_enc], "decoder_self": calls[n_enc::2], "cross": calls[n_enc + 1::2]}
    return {kind: torch.stack(maps).cpu() for kind, maps in found.items()}
