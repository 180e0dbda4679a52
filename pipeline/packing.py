"""Token-bucket packing, the one definition: positions grouped by length under a padded-token cap.

Used by decoding's batches (``pipeline.decoding.batching.plan_batches``) and the dev loss's
(``pipeline.batch_plan.step_groups.plan_eval_batches``). Pure Python on a list of
lengths, so any phase can import it (the core imports no stage).
"""

from __future__ import annotations

from typing import Sequence


def pack_by_length(lengths: Sequence[int], max_padded_tokens: int) -> list[list[int]]:
    """Positions sorted by (length, position), then cut greedily into batches while
    (sentences * longest) <= ``max_padded_tokens`` padded tokens; one longer than the cap gets a
    batch of its own (nothing is dropped). Batches come shortest first."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        # lengths ascend, so a batch's longest is its newest member
        if current and (len(current) + 1) * lengths[i] > max_padded_tokens:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches
