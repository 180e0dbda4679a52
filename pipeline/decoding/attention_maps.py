"""What the model attended to when it made one translation: ``translation_attention``, the one
function behind the score report's heatmaps (``pipeline.evaluate.attention_plots``), the Serve
app's ``"attention": true`` and its page, so all three show the same numbers.

A teacher-forced pass over (source, the model's own hypothesis) through ``model``'s
``attention_weights``: every layer's and head's softmax(Q K^T / sqrt(d_k)) (§3.2.1)
of the encoder's self-attention, the decoder's masked self-attention and its cross-attention.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from model import Transformer
from model.attention_weights import KINDS, attention_weights


@dataclass
class TranslationAttention:
    """Pieces on the axes and the weights: ``maps[kind]`` is (layers, heads, rows, columns); rows of
    the decoder maps are the output pieces (the query at position t produces piece t), columns of
    the cross map and every axis of the encoder map are the source pieces; each row sums to 1."""

    src_pieces: list[str]  # the source's pieces, then "</s>"
    tgt_pieces: list[str]  # the hypothesis's pieces, then "</s>"
    maps: dict[str, torch.Tensor]  # "encoder_self" (L, h, S, S), "decoder_self" (L, h, T, T), "cross" (L, h, T, S)

    def to_json(self) -> dict[str, Any]:
        """JSON-able: pieces, and each map as nested lists [layer][head][row][column] of floats."""
        return {"src_pieces": self.src_pieces, "tgt_pieces": self.tgt_pieces,
                **{kind: self.maps[kind].tolist() for kind in KINDS}}


@torch.no_grad()
def translation_attention(model: Transformer, sp: Any, src_ids: Sequence[int], hypothesis: str) -> TranslationAttention:
    """The attention of `model` translating `src_ids` (pieces, no eos) into `hypothesis` (its own
    output as text, re-encoded with the SentencePiece processor `sp`)."""
    cfg = model.cfg
    src = [int(t) for t in src_ids] + [cfg.eos_id]
    tgt = [cfg.bos_id] + sp.encode(hypothesis, out_type=int)
    maps = attention_weights(model, src, tgt)
    src_pieces = [sp.id_to_piece(t) for t in src[:-1]] + ["</s>"]
    tgt_pieces = [sp.id_to_piece(t) for t in tgt[1:]] + ["</s>"]
    return TranslationAttention(src_pieces, tgt_pieces, maps)
