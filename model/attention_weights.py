"""What a trained model attends to: the attention weights softmax(Q K^T / sqrt(d_k)) (§3.2.1) of
every layer and head, for one sentence pair, as the paper draws them (Figures 3-5), and the
queries, keys and values they came from.

The model's forward pass never materializes these weights (it calls
``F.scaled_dot_product_attention``, which returns only the weighted values). ``record_attention``
hooks each `ScaledDotProductAttention` module of the model, from outside (the layers know nothing
of it; once per model, and the hooks stay), runs one teacher-forced forward pass of a sentence pair
and keeps the queries, keys, values, mask and scale of each call (`AttentionCall`), in this thread
only; ``attention_weights`` computes every call's weights from them. The pass's own outputs are
unchanged. One sentence at a time, so no padding enters any row. Torch only.
"""

from __future__ import annotations

import threading
from typing import NamedTuple, Sequence

import torch

from .transformer import ScaledDotProductAttention

KINDS = ("encoder_self", "decoder_self", "cross")

_RECORDING = threading.local()  # .calls: the list this thread's `record_attention` fills, if any
_HOOKING = threading.Lock()


class AttentionCall(NamedTuple):
    """One attention call as the model made it: q (B, h, Tq, hs), k and v (B, h, Tk, hs), each head
    zero-padded to hs = max(d_k, d_v) (`model.compute`); SDPA's mask (True = may attend), causal flag
    and scale (None: SDPA's 1/sqrt(hs))."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    attn_mask: torch.Tensor | None
    is_causal: bool
    scale: float | None

    @property
    def scale_factor(self) -> float:
        """The factor SDPA multiplies q.k by: 1/sqrt(d_k) (§3.2.1)."""
        return self.scale if self.scale is not None else self.q.shape[-1] ** -0.5

    def dots(self) -> torch.Tensor:
        """q.k for every query and key, before scaling: (B, h, Tq, Tk), fp32."""
        return self.q.float() @ self.k.float().transpose(-2, -1)

    def allowed(self) -> torch.Tensor:
        """(B, h, Tq, Tk) bool, True = the query may attend to the key (causal mask and padding)."""
        B, h, tq, _ = self.q.shape
        tk = self.k.shape[-2]
        allowed = torch.ones(B, h, tq, tk, dtype=torch.bool, device=self.q.device)
        if self.is_causal:
            allowed &= torch.ones(tq, tk, dtype=torch.bool, device=self.q.device).tril()
        if self.attn_mask is not None:
            allowed &= self.attn_mask
        return allowed

    def weights(self, scaled: bool = True) -> torch.Tensor:
        """(B, h, Tq, Tk): SDPA's softmax, explicitly (fp32); scaled=False leaves out 1/sqrt(d_k)."""
        scores = self.dots() * self.scale_factor if scaled else self.dots()
        return scores.masked_fill(~self.allowed(), float("-inf")).softmax(-1)


def _keep_call(module: ScaledDotProductAttention, args: tuple) -> None:
    """The forward pre-hook: the call's (q, k, v, mask, scale), all positional, into this thread's
    recording, if there is one (never while torch.compile traces)."""
    calls = getattr(_RECORDING, "calls", None)
    if calls is not None and not torch.compiler.is_compiling():
        q, k, v, mask, scale = args
        calls.append(AttentionCall(q, k, v, mask.keys, mask.causal, scale))


def _hook(model: torch.nn.Module) -> None:
    """Hook every attention of `model` that is not hooked yet (a copy of a hooked model is). A hook
    is one insert into the module's hook dict, which torch reads in one step, so other threads
    running the model meanwhile are safe."""
    with _HOOKING:
        for module in model.modules():
            if isinstance(module, ScaledDotProductAttention) and _keep_call not in module._forward_pre_hooks.values():
                module.register_forward_pre_hook(_keep_call)


@torch.no_grad()
def record_attention(model: torch.nn.Module, src_ids: Sequence[int], tgt_in_ids: Sequence[int]
                     ) -> dict[str, list[AttentionCall]]:
    """One pair through `model` (a `Transformer`): ``src_ids`` = pieces + [eos], ``tgt_in_ids`` =
    [bos] + pieces (e.g. the model's own translation). Returns each kind's calls, one per layer:
    {"encoder_self": [L_enc], "decoder_self": [L_dec], "cross": [L_dec]}, each of batch 1.

    The pass calls attention in a fixed order (every encoder layer's, then each decoder layer's
    self- and cross-attention), recorded for this thread only: a server may decode other requests
    with the same model meanwhile."""
    _hook(model)
    calls: list[AttentionCall] = []
    was_training = model.training  # no dropout in the pass (a served model is in eval mode already)
    model.eval()
    device = next(model.parameters()).device
    _RECORDING.calls = calls
    try:
        model(torch.tensor([list(src_ids)], device=device), torch.tensor([list(tgt_in_ids)], device=device))
    finally:
        _RECORDING.calls = None
        model.train(was_training)
    n_enc, n_dec = len(model.encoder_layers), len(model.decoder_layers)
    if len(calls) != n_enc + 2 * n_dec:
        raise RuntimeError(f"record_attention: {len(calls)} attention calls, expected {n_enc + 2 * n_dec}")
    return {"encoder_self": calls[:n_enc], "decoder_self": calls[n_enc::2], "cross": calls[n_enc + 1::2]}


def attention_weights(model: torch.nn.Module, src_ids: Sequence[int], tgt_in_ids: Sequence[int]
                      ) -> dict[str, torch.Tensor]:
    """The maps of one pair (`record_attention`'s arguments): {"encoder_self": (L_enc, h, S, S),
    "decoder_self": (L_dec, h, T, T), "cross": (L_dec, h, T, S)}: row i of a map is query position
    i's distribution over the keys."""
    return maps_of(record_attention(model, src_ids, tgt_in_ids))


def maps_of(calls: dict[str, list[AttentionCall]]) -> dict[str, torch.Tensor]:
    """`attention_weights` from recorded calls: each layer's (h, Tq, Tk) weights, stacked, on the CPU."""
    return {kind: torch.stack([c.weights()[0] for c in layer_calls]).cpu() for kind, layer_calls in calls.items()}
