"""Right padding: where the real tokens of a (B, T) batch sit, and the mask that hides the pads.

Position-wise work (projections, FFN, LayerNorm, dropout) runs on the M real positions only, as
(M, d) rows (`Positions.pack`); attention scatters them back into (B, T, .) (`Positions.unpack`).
Outputs at pad positions are never computed. Boolean attention masks follow
`F.scaled_dot_product_attention`: True = this key may be attended to.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def key_padding_to_attn_mask(pad_mask: torch.Tensor) -> torch.Tensor:
    """(B, S) bool True = pad  ->  (B, 1, 1, S) bool True = may attend (SDPA convention)."""
    return ~pad_mask[:, None, None, :]


class Positions:
    """The M real (non-pad) positions of a right-padded (B, T) batch: `index` (M,) long holds
    their flat positions b * T + t, row-major."""

    def __init__(self, keep: torch.Tensor, index: torch.Tensor | None = None):  # (B, T) bool, True = real
        self.B, self.T = keep.shape
        # `nonzero` waits for the device (its size is data-dependent): training passes the index
        # computed on the host with the batch (`index`, the same positions), so a step never syncs.
        self.index = keep.reshape(-1).nonzero()[:, 0] if index is None else index  # (M,)

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """(M, c) -> (B, T, c), zeros at pad positions."""
        return x.new_zeros(self.B * self.T, x.shape[1]).index_copy(0, self.index, x).view(self.B, self.T, -1)

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, ...) -> (M, ...)."""
        return x.reshape(self.B * self.T, *x.shape[2:]).index_select(0, self.index)


@dataclass(frozen=True)
class NonPad:
    """`Transformer.forward`'s request to compute the decoder at the non-pad target positions only
    (the loss needs no other), with the flat non-pad positions of the source and the decoder input
    when the caller has them (`pipeline.train.token_batches.collate` computes them on the host, so a
    step needs no device-to-host sync to find them); None: found on the device."""

    src_index: torch.Tensor | None = None  # (Ms,) flat non-pad positions of src_ids
    tgt_index: torch.Tensor | None = None  # (M,) flat non-pad positions of tgt_in_ids
