"""The positional encodings of one source sentence as the model adds them (§3.5), beside its token
embeddings: what lets attention, which is blind to order, tell positions apart.

For the n source positions: the rows of the table the model adds (`Transformer.position_table`:
the sinusoids, or the learned table of Table 3 row E), their dot products (for sinusoids
PE(i).PE(j) = sum_k cos(w_k (i - j)): a function of the offset i - j only, largest at 0), and the
norms of the token embeddings as the model scales them (x sqrt(d_model), §3.4) beside the
encodings' norms (sqrt(d_model / 2) for every sinusoid row), which shows how much of each input
vector is position and how much is token.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from model import Transformer


@torch.no_grad()
def positional_view(model: Transformer, src_ids: Sequence[int]) -> dict[str, Any]:
    """`src_ids` (pieces + [eos]) -> {"table": (n, d_model), "dots": (n, n), "embedding_norms": [n],
    "pe_norms": [n]} as nested lists of floats."""
    n = len(src_ids)
    table = model.position_table()[:n].detach().float().cpu()  # (n, d)
    ids = torch.tensor(list(src_ids), device=model.src_embed.weight.device)
    embedded = model.src_embed(ids).float().cpu() * model.emb_scale  # (n, d), as `Transformer.embed` scales it
    return {"table": table.tolist(), "dots": (table @ table.T).tolist(),
            "embedding_norms": embedded.norm(dim=-1).tolist(), "pe_norms": table.norm(dim=-1).tolist()}
