"""What the model attended to when it made one translation: ``translation_attention``, the one
function behind the score report's heatmaps (``pipeline.evaluate.attention_plots``), the Serve
app's ``"attention": true`` and its page, so all three show the same numbers.

A teacher-forced pass over (source, the model's own hypothesis) through ``model``'s
``record_attention``: every layer's and head's softmax(Q K^T / sqrt(d_k)) (§3.2.1)
of the encoder's self-attention, the decoder's masked self-attention and its cross-attention;
each head's measured character (``attention_heads``) and the source's positional encodings
(``positional_view``). ``attention_explain`` opens one row of one head from the same pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from model import Transformer
from model.attention_weights import KINDS, maps_of, record_attention
from pipeline.decoding.attention_heads import all_head_characters
from pipeline.decoding.positional_view import positional_view


@dataclass(kw_only=True)
class TranslationAttention:
    """Pieces on the axes and the weights: ``maps[kind]`` is (layers, heads, rows, columns); rows of
    the decoder maps are the output pieces (the query at position t produces piece t), columns of
    the cross map and every axis of the encoder map are the source pieces; each row sums to 1."""

    src_pieces: list[str]  # the source's pieces, then "</s>"
    tgt_pieces: list[str]  # the hypothesis's pieces, then "</s>"
    maps: dict[str, torch.Tensor]  # "encoder_self" (L, h, S, S), "decoder_self" (L, h, T, T), "cross" (L, h, T, S)
    heads: dict[str, list[list[dict[str, Any]]]]  # kind -> [layer][head] -> {"label", measures} (attention_heads)
    positional: dict[str, Any]  # the source's positional encodings and embedding norms (positional_view)

    def to_json(self) -> dict[str, Any]:
        """JSON-able: pieces, each map as nested lists [layer][head][row][column] of floats, "heads"
        and "positional"."""
        return {"src_pieces": self.src_pieces, "tgt_pieces": self.tgt_pieces,
                **{kind: self.maps[kind].tolist() for kind in KINDS},
                "heads": self.heads, "positional": self.positional}


@dataclass(frozen=True)
class TeacherForced:
    """The pair a translation's attention is computed on, and the pieces that name its positions."""

    src: list[int]  # source pieces + [eos]
    tgt_in: list[int]  # [bos] + the hypothesis's pieces
    src_pieces: list[str]
    tgt_pieces: list[str]  # the piece each decoder position produces: the hypothesis's, then "</s>"


def teacher_forced(model: Transformer, sp: Any, src_ids: Sequence[int], hypothesis: str) -> TeacherForced:
    """`src_ids` (pieces, no eos) and `hypothesis` (the model's output as text, re-encoded with the
    SentencePiece processor `sp`) as the model's inputs."""
    cfg = model.cfg
    src = [int(t) for t in src_ids] + [cfg.eos_id]
    tgt = [cfg.bos_id] + sp.encode(hypothesis, out_type=int)
    return TeacherForced(src, tgt, [sp.id_to_piece(t) for t in src[:-1]] + ["</s>"],
                         [sp.id_to_piece(t) for t in tgt[1:]] + ["</s>"])


@torch.no_grad()
def translation_attention(model: Transformer, sp: Any, src_ids: Sequence[int], hypothesis: str) -> TranslationAttention:
    """The attention of `model` translating `src_ids` (pieces, no eos) into `hypothesis` (its own
    output as text, re-encoded with the SentencePiece processor `sp`)."""
    pair = teacher_forced(model, sp, src_ids, hypothesis)
    maps = maps_of(record_attention(model, pair.src, pair.tgt_in))
    return TranslationAttention(src_pieces=pair.src_pieces, tgt_pieces=pair.tgt_pieces, maps=maps,
                                heads=all_head_characters(maps, pair.src_pieces, pair.tgt_pieces),
                                positional=positional_view(model, pair.src))
