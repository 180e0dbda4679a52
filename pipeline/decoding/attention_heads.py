"""Each attention head's character over one sentence, measured from its weights and named in one
line ("mostly attends to the previous piece: 71%"), for the score report and the Serve app.

A head's measures over its (Lq, Lk) map, each the mean over the rows where it is defined:
- ``same``, ``previous``, ``next``: the weight on key position i, i-1, i+1 from query i
  (self-attention only: a target and a source position share no index, so null for cross);
- ``first``, ``last``: the weight on the first and the last key (the source's ``</s>``; null for
  the decoder's masked self-attention, where only the last query sees the last key);
- ``top_key``: the key with the most weight: its index, piece and mean weight;
- ``monotone`` (cross-attention only): the share of query rows i >= 1 whose most-attended source
  position (argmax) is at or after row i-1's, i.e. how often the alignment moves forward or stays,
  as a monotone alignment always does; null for a one-row map;
- ``coverage`` (cross-attention only): the share of source positions that are some row's argmax
  (a head whose argmax never leaves one piece is monotone too, but follows nothing);
- ``entropy``: the rows' mean entropy (nats): 0 for one-hot rows, ln(Lk) for uniform ones.
The label names the largest of the position measures (``same`` .. ``top_key``) when it holds at
least ``MOSTLY`` of the weight; otherwise a cross head that is at least ``MONOTONE`` monotone and
covers at least ``COVERAGE`` of the source "follows the source in order"; otherwise the head
"spreads its weight".
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

MOSTLY = 0.5  # a position measure at least this large names the head
MONOTONE = 0.8  # a cross head whose argmax moves forward or stays this often ...
COVERAGE = 0.5  # ... and lands on this share of the source positions follows the source in order


def _diagonal_mean(w: torch.Tensor, offset: int) -> float | None:
    """Mean of w[i, i + offset] over the rows i where that key exists."""
    d = torch.diagonal(w, offset=offset)
    return float(d.mean()) if d.numel() else None


def head_measures(w: torch.Tensor, kind: str, key_pieces: Sequence[str] | None = None) -> dict[str, Any]:
    """The measures of the module doc for one head's (Lq, Lk) weights of attention `kind`."""
    w = w.float()
    selfish = kind != "cross"
    column = w.mean(0)  # (Lk,) mean weight per key
    top = int(column.argmax())
    argmax = w.argmax(-1)
    logs = torch.where(w > 0, w.log(), torch.zeros_like(w))
    return {
        "same": _diagonal_mean(w, 0) if selfish else None,
        "previous": _diagonal_mean(w, -1) if selfish else None,
        "next": _diagonal_mean(w, 1) if selfish else None,
        "first": float(column[0]),
        "last": None if kind == "decoder_self" else float(column[-1]),
        "top_key": {"index": top, "piece": key_pieces[top] if key_pieces else None, "share": float(column[top])},
        "monotone": (float((argmax[1:] >= argmax[:-1]).float().mean()) if kind == "cross" and len(argmax) > 1
                     else None),
        "coverage": len(set(argmax.tolist())) / w.shape[1] if kind == "cross" else None,
        "entropy": float(-(w * logs).sum(-1).mean()),
    }


def head_label(m: dict[str, Any]) -> str:
    """The one-line name of a head from its `head_measures` (the rule of the module doc)."""
    top = m["top_key"]
    piece = f' "{top["piece"]}"' if top["piece"] is not None else ""
    candidates = [(m["same"], "the same piece"), (m["previous"], "the previous piece"), (m["next"], "the next piece"),
                  (m["first"], "the first piece"), (m["last"], "the last piece"),
                  (top["share"], f"the piece{piece} at position {top['index']}")]
    share, where = max(((s, w) for s, w in candidates if s is not None), key=lambda c: c[0])  # first wins ties
    if share >= MOSTLY:
        return f"mostly attends to {where}: {share:.0%}"
    if m["monotone"] is not None and m["monotone"] >= MONOTONE and m["coverage"] >= COVERAGE:
        return (f"follows the source in order: {m['monotone']:.0%} of steps move forward or stay, "
                f"over {m['coverage']:.0%} of it")
    return f"spreads its weight: at most {share:.0%} on {where}"


def head_characters(weights: torch.Tensor, kind: str, key_pieces: Sequence[str] | None = None
                    ) -> list[dict[str, Any]]:
    """(h, Lq, Lk) weights of one layer -> per head {"label", **measures}."""
    out = []
    for w in weights:
        m = head_measures(w, kind, key_pieces)
        out.append({"label": head_label(m), **m})
    return out


def all_head_characters(maps: dict[str, torch.Tensor], src_pieces: Sequence[str], tgt_pieces: Sequence[str]
                        ) -> dict[str, list[list[dict[str, Any]]]]:
    """Every kind's (L, h, Lq, Lk) maps -> [layer][head] -> {"label", **measures}; keys are named
    by the source pieces (encoder, cross) or the decoder's pieces (decoder self-attention)."""
    keys = {"encoder_self": src_pieces, "decoder_self": tgt_pieces, "cross": src_pieces}
    return {kind: [head_characters(layer, kind, keys[kind]) for layer in m] for kind, m in maps.items()}
