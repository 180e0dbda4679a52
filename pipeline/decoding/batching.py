"""Batching for decoding (pure, no Ray): which sources go together, how each becomes a model input.

``prepare_sources`` (empty / too-long sources), ``plan_batches`` (length-sorted, token-bounded
batches), ``pad_batch``, and for an encoded split ``read_split`` (its Parquet shards in ``idx``
order) and ``plan_split`` (the rows to translate, batch by batch, and the split's counts).

Bad input never stops a decode or shifts a line: an empty source gives an empty line
(``num_empty``); a source that would not fit the model's positions together with its output
budget is truncated to ``max_source_len`` pieces (``num_truncated``).
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np
import pandas as pd
import torch

from pipeline import storage
from pipeline.packing import pack_by_length


def prepare_sources(pieces: Iterable[Sequence[int]], max_len: int, eos_id: int
                    ) -> tuple[list[list[int] | None], list[bool]]:
    """Model inputs ``pieces + [eos]`` cut to ``max_len`` tokens (eos kept); None for an empty
    source (no pieces), which is not translated. Returns (sources, truncated flags)."""
    sources: list[list[int] | None] = []
    truncated: list[bool] = []
    for p in pieces:
        p = [int(t) for t in p]
        if not p:
            sources.append(None)
            truncated.append(False)
            continue
        cut = len(p) + 1 > max_len
        sources.append((p[: max_len - 1] if cut else p) + [eos_id])
        truncated.append(cut)
    return sources, truncated


def plan_batches(lengths: Sequence[int], batch_tokens: int) -> list[list[int]]:
    """Positions in batches of similar length, at most ``batch_tokens`` padded source tokens each
    (``pack_by_length``); longest batches first, so the slowest work is not left for last."""
    return pack_by_length(lengths, batch_tokens)[::-1]


def pad_batch(sources: Sequence[Sequence[int]], pad_id: int) -> torch.Tensor:
    """(B, S) long, right-padded with pad_id."""
    width = max(len(s) for s in sources)
    out = torch.full((len(sources), width), pad_id, dtype=torch.long)
    for r, s in enumerate(sources):
        out[r, : len(s)] = torch.as_tensor(np.asarray(s, dtype=np.int64))
    return out


def read_split(uri: str, columns: list[str]) -> pd.DataFrame:
    """An encoded split's Parquet shards as one DataFrame in ``idx`` order (idx must be unique)."""
    import pyarrow.dataset as pads

    fs, path = storage.resolve(uri)
    table = pads.dataset(path, filesystem=fs, format="parquet").to_table(columns=columns)
    df = table.to_pandas().sort_values("idx", kind="stable").reset_index(drop=True)
    if df["idx"].duplicated().any():
        raise ValueError(f"{uri}: duplicate idx values; the split's order cannot be restored")
    return df


def plan_split(split: str, df: pd.DataFrame, max_len: int, eos_id: int, batch_tokens: int,
               first_batch_id: int = 0) -> tuple[pd.DataFrame, dict[str, int]]:
    """Rows to translate (split, idx, batch_id, src_ids) and the split's counts."""
    sources, truncated = prepare_sources(df["src_ids"], max_len, eos_id)
    keep = [i for i, s in enumerate(sources) if s is not None]
    batches = plan_batches([len(sources[i]) for i in keep], batch_tokens)
    rows = []
    for b, members in enumerate(batches):
        for m in members:
            i = keep[m]
            rows.append((split, int(df["idx"].iat[i]), first_batch_id + b, sources[i]))
    counts = {"num_sentences": len(df), "num_empty": len(df) - len(keep),
              "num_truncated": int(sum(truncated)), "num_batches": len(batches)}
    return pd.DataFrame(rows, columns=["split", "idx", "batch_id", "src_ids"]), counts
