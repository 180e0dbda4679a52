"""Micro-batches of stable shape (`speed.shape_buckets`): pure numpy, no torch, no Ray.

Token-bucketed steps give every micro-batch a new (rows B, source columns S, target columns T,
computed source positions Ms, computed target positions Mt). On a GPU each new shape has its
kernels chosen anew (cuDNN's SDPA builds a plan per shape, cuBLAS picks a GEMM per shape; what
that costs: docs/benchmarks.md), and a run rarely repeats one, so without buckets a GPU run spends
much of its time choosing kernels. Here every one of the five sizes is rounded up to a *ladder*: the numbers
whose binary form has at most `bits` significant bits (bits = 4: 8, 9, ..., 15, 16, 18, ..., 30,
32, 36, ...: 8 values per octave, each at most 12.5% above the last), and the sizes are tied
(`ShapeBuckets`). A micro-batch's shape is then one of a few dozen per epoch, and kernel and
attention-plan choices are made once per run.

The padding is masked, as all padding is (`pipeline.train.feeder.collate`): added rows have a source of
[eos] and a decoder input of [bos] whose target is pad (ignored by the loss); added positions
are pad positions. Losses and gradients equal the unpadded step's (tests/unit/train/test_shapes.py).
What it costs is the padding overhead: computed positions (Ms + Mt, what the matmuls see) over
real ones; `epoch_report` counts both the shapes and that overhead over an epoch's batch plan,
and `--plan` prints them for the config's corpus.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

Shape = tuple[int, int, int, int, int]  # (B rows, S source columns, T target columns, Ms, Mt computed positions)


def ladder(x: int, bits: int) -> int:
    """The smallest number >= x with at most `bits` significant bits (x >= 1)."""
    x = max(int(x), 1)
    drop = max(x.bit_length() - bits, 0)
    return -(-x >> drop) << drop  # ceil(x / 2^drop) * 2^drop, which may carry into one more bit


@dataclass(frozen=True)
class ShapeBuckets:
    """The ladders a micro-batch's sizes are rounded up to.

    Five free sizes would multiply into hundreds of shapes per epoch (base, 4.5M pairs, 8 workers:
    346 with 4 bits each), so they are tied: the source and target get one width W (the longer
    side's, on a coarse ladder: attention is a small part of a step's FLOPs) and one position
    count M (the larger of Ms and Mt, on a fine ladder: the matmuls pay for every position).
    Measured on base's batch plan over 4.5M pairs of the bill's assumed lengths (tests/unit/train/
    test_shapes.py, and `--plan` for a config's own corpus): 60 shapes, 5.7% padding, on 8 workers."""

    width_bits: int = 2  # W in 8, 12, 16, 24, 32, 48, ...: the columns of source and target
    rows_bits: int = 2  # B in 8, 12, 16, 24, ...
    positions_bits: int = 4  # M: 8 values per octave, <= 12.5% above the real count (~3% on average)
    min_rows: int = 8  # B is at least this (a ladder from 1 would add a shape per small batch)

    def shape(self, B: int, S: int, T: int, Ms: int, Mt: int, max_width: int = 0) -> Shape:
        """The bucketed shape (B, W, W, M, M) of a micro-batch whose real sizes are these (S, T:
        columns with the special token; Ms, Mt: real positions). `max_width` (> 0): no more
        columns than the model has positions (the top rung is cut to it)."""
        W = ladder(max(S, T), self.width_bits)
        W = min(W, max_width) if max_width > 0 else W
        Bb = ladder(max(B, self.min_rows), self.rows_bits)
        M = ladder(max(Ms, Mt), self.positions_bits)
        # The computed positions must fit the padded batch: more rows if they do not (a batch of
        # near-equal lengths whose position count rounds up past rows x columns).
        while M > Bb * W:
            Bb = ladder(Bb + 1, self.rows_bits)
        return Bb, W, W, M, M


def real_shape(src_len: np.ndarray, tgt_len: np.ndarray) -> Shape:
    """The unbucketed shape of a micro-batch of pairs with these piece counts (one special token a side)."""
    s, t = src_len.astype(np.int64) + 1, tgt_len.astype(np.int64) + 1
    return len(s), int(s.max(initial=1)), int(t.max(initial=1)), int(s.sum()), int(t.sum())


@dataclass(frozen=True, kw_only=True)
class EpochShapes:
    """What `epoch_report` found over one epoch's micro-batches."""

    num_micro_batches: int
    num_shapes: int  # distinct bucketed shapes
    num_real_shapes: int  # distinct shapes without buckets
    real_positions: int  # source + target positions of the real tokens
    computed_positions: int  # source + target positions the bucketed micro-batches compute
    attention_cells: int  # sum of B x h-less attention cells (B S^2 + B T^2 + B T S), bucketed
    real_attention_cells: int  # the same for the unbucketed micro-batches

    @property
    def padding_pct(self) -> float:
        """Computed positions over real ones, in % above 100 (what the matmuls pay)."""
        return 100.0 * (self.computed_positions / max(self.real_positions, 1) - 1.0)

    @property
    def attention_padding_pct(self) -> float:
        return 100.0 * (self.attention_cells / max(self.real_attention_cells, 1) - 1.0)

    def format(self) -> str:
        return (f"{self.num_micro_batches:,} micro-batches in {self.num_shapes} distinct shapes "
                f"(without buckets: {self.num_real_shapes:,}); padding overhead {self.padding_pct:.1f}% of the "
                f"positions the matmuls compute, {self.attention_padding_pct:.1f}% of the attention cells "
                "above the unbucketed batches")


def _cells(shape: Shape) -> int:
    B, S, T = shape[:3]
    return B * (S * S + T * T + T * S)


def epoch_report(micro_batches: list[tuple[np.ndarray, np.ndarray]], buckets: ShapeBuckets,
                 max_width: int = 0) -> EpochShapes:
    """Shapes and padding of these micro-batches ((src_len, tgt_len) of each, in pieces)."""
    shapes, reals = set(), set()
    real = computed = cells = real_cells = 0
    for src, tgt in micro_batches:
        r = real_shape(src, tgt)
        b = buckets.shape(*r, max_width=max_width)
        shapes.add(b)
        reals.add(r)
        real += r[3] + r[4]
        computed += b[3] + b[4]
        cells += _cells(b)
        real_cells += _cells(r)
    return EpochShapes(num_micro_batches=len(micro_batches), num_shapes=len(shapes), num_real_shapes=len(reals),
                       real_positions=real, computed_positions=computed, attention_cells=cells,
                       real_attention_cells=real_cells)
