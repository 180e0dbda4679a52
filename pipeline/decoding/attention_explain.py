"""How one attention head computed one query's row, with the model's own numbers (§3.2.1):
Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V, then the heads' concatenation times W_O (§3.2.2).

``explain_attention`` opens the teacher-forced pass of ``attention_maps`` (the same inputs, the
same recorded calls, the same weights function) at one (kind, layer, head, query): the query
vector, every key's key and value vectors, q.k, q.k / sqrt(d_k), the mask, the softmax with and
without the scaling, the head's output sum_j w_j v_j, and that output through the head's columns
of W_O with its share among the heads. Nothing is recomputed by a second model: q, k and v are
the ones the model's attention received (`model.attention_weights.record_attention`).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from model import ModelConfig, Transformer
from model.attention_weights import KINDS, AttentionCall, record_attention
from pipeline.decoding.attention_maps import teacher_forced


def attention_module(model: Transformer, kind: str, layer: int) -> torch.nn.Module:
    """The attention block of (kind, layer): a `SelfAttention` or `CrossAttention`."""
    if kind == "encoder_self":
        return model.encoder_layers[layer].self_attn
    block = model.decoder_layers[layer]
    return block.self_attn if kind == "decoder_self" else block.cross_attn


def explain_problem(cfg: ModelConfig, kind: Any, layer: Any, head: Any, query: Any, n_queries: int | None
                    ) -> str | None:
    """What is wrong with asking for (kind, layer, head, query) of a model with config `cfg` and a
    sentence whose `kind` map has `n_queries` rows (None: not known yet), naming the culprit; None if nothing."""
    if kind not in KINDS:
        return f'"kind" must be one of {", ".join(KINDS)}; got {kind!r}'
    for name, value in (("layer", layer), ("head", head), ("query", query)):
        if isinstance(value, bool) or not isinstance(value, int):
            return f'"{name}" must be an integer; got {value!r}'
    n_layers = cfg.n_encoder_layers if kind == "encoder_self" else cfg.n_decoder_layers
    limits = (("layer", layer, n_layers, f"the model's {kind} layers"), ("head", head, cfg.n_heads, "heads"),
              ("query", query, n_queries, f"query positions of this sentence's {kind} map (eos included)"))
    for name, value, n, what in limits:
        if n is not None and not 0 <= value < n:
            return f'"{name}" {value} is out of range: there are {n} {what}, numbered 0 to {n - 1}'
    return None


def _values(t: torch.Tensor, masked: torch.Tensor | None = None) -> list:
    """A 1-d tensor as floats, None where `masked`."""
    out = t.tolist()
    return out if masked is None else [None if m else x for x, m in zip(out, masked.tolist())]


def _entropy(w: torch.Tensor) -> float:
    return float(-(w * torch.where(w > 0, w.log(), torch.zeros_like(w))).sum())


@torch.no_grad()
def explain_row(module: torch.nn.Module, call: AttentionCall, head: int, query: int) -> dict[str, Any]:
    """One row of one head from a recorded call (batch 1) of attention block `module`: the numbers
    of the module doc, without the names of positions."""
    hd = module.heads
    d_k, d_v = hd.d_k, hd.d_v
    allowed = call.allowed()[0, head, query]  # (Lk,)
    dots = call.dots()[0, head, query]
    weights = call.weights()[0]  # (h, Lq, Lk): the maps' own computation, so the rows are theirs exactly
    v = call.v[0, :, :, :d_v].float()  # (h, Lk, d_v)
    outputs = torch.einsum("hk,hkd->hd", weights[:, query], v)  # (h, d_v): each head's output at this query
    w_o = module.out_proj.weight.detach().float()  # (d_model, h * d_v): W_O, its columns by head
    contributions = torch.stack([w_o[:, i * d_v:(i + 1) * d_v] @ outputs[i] for i in range(hd.n_heads)])
    norms = contributions.norm(dim=-1)
    row = weights[head, query]
    unscaled = call.weights(scaled=False)[0, head, query]
    return {"d_k": d_k, "d_v": d_v, "scale": call.scale_factor,
            "q": call.q[0, head, query, :d_k].float().tolist(), "keys": call.k[0, head, :, :d_k].float().tolist(),
            "values": v[head].tolist(), "scores": _values(dots, ~allowed),
            "scaled": _values(dots * call.scale_factor, ~allowed), "mask": allowed.tolist(),
            "weights": row.tolist(), "weights_unscaled": unscaled.tolist(),
            "entropy": {"scaled": _entropy(row), "unscaled": _entropy(unscaled)},
            "output": outputs[head].tolist(),
            "w_o": {"contribution": contributions[head].tolist(), "norm": float(norms[head]),
                    "share": float(norms[head] / norms.sum())}}


@torch.no_grad()
def explain_attention(model: Transformer, sp: Any, src_ids: Sequence[int], hypothesis: str, kind: str,
                      layer: int, head: int, query: int) -> dict[str, Any]:
    """How head `head` of layer `layer`'s `kind` attention computed query position `query`'s row
    when `model` translated `src_ids` (pieces, no eos) into `hypothesis` (its own output as text,
    re-encoded with `sp`), as `translation_attention` maps it. Positions are named as in its maps:
    source pieces then "</s>"; decoder positions by the piece they produce. A JSON-able dict
    (docs/using.md lists its fields); masked positions have null scores and weight 0."""
    pair = teacher_forced(model, sp, src_ids, hypothesis)
    n_rows = len(pair.src) if kind == "encoder_self" else len(pair.tgt_in)
    problem = explain_problem(model.cfg, kind, layer, head, query, n_rows)
    if problem:
        raise ValueError(problem)
    call = record_attention(model, pair.src, pair.tgt_in)[kind][layer]
    queries = pair.src_pieces if kind == "encoder_self" else pair.tgt_pieces
    keys = pair.tgt_pieces if kind == "decoder_self" else pair.src_pieces
    return {"kind": kind, "layer": layer, "head": head, "query": query, "query_piece": queries[query],
            "key_pieces": keys, **explain_row(attention_module(model, kind, layer), call, head, query)}
