"""Transformer (Vaswani et al., 2017) for WMT14 EN-DE: architecture, loss, schedule, search.

transformer   the architecture as §3 writes it: `Transformer(cfg, cpu_kernels=True)`;
              `model(src, tgt_in, nonpad=None)` -> decoder output, `model.logits(h)` -> logits
compute       how the layers are computed beside §3: the heads (widths when d_k, d_v differ from
              d_model / h: Table 3 A, B), the real (non-pad) positions (`Positions`, `NonPad`), the
              `Mask` each attention call gets; CPU dropout, fp32 CPU attention for bf16 gradients,
              in-place residual adds
training      §5: Adam and the learning-rate schedule (§5.3), the label-smoothed loss (§5.4)
incremental   decoding one token at a time: `DecoderState`, the fused eval-mode decoder step
search        greedy and beam search over the `DecodingModel` protocol
attention_weights  the attention maps of a sentence pair (the paper's Figures 3-5)
averaging, config: checkpoint averaging, the model's sizes

Imports torch and the standard library only. The names below load their module on first use
(PEP 562), so `model.config` (the sizes, which the pipeline's config is built on) costs no torch
import: a data stage's Ray workers and `--help` never load torch (~3 s of a process's start on 2 cores).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# name -> the module of this package that defines it
_WHERE = {
    "average_checkpoints": "averaging",
    "SIZES": "config", "ModelConfig": "config", "ModelSizes": "config", "Positional": "config", "size_name": "config",
    "DecoderState": "incremental",
    "NonPad": "compute",
    "ADAM_BETAS": "training", "ADAM_EPS": "training", "label_smoothed_nll": "training",
    "linear_label_smoothed_nll": "training", "make_optimizer": "training", "make_scheduler": "training",
    "noam_lambda": "training", "noam_lr": "training",
    "DecodingModel": "search", "beam_search": "search", "gnmt_length_penalty": "search", "greedy_search": "search",
    "max_source_len": "search", "output_budget": "search",
    "Transformer": "transformer", "sinusoid_table": "transformer",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # what type checkers and readers see
    from .averaging import average_checkpoints  # noqa: F401
    from .config import SIZES, ModelConfig, ModelSizes, Positional, size_name  # noqa: F401
    from .incremental import DecoderState  # noqa: F401
    from .compute import NonPad  # noqa: F401
    from .training import (ADAM_BETAS, ADAM_EPS, label_smoothed_nll, linear_label_smoothed_nll,  # noqa: F401
                           make_optimizer, make_scheduler, noam_lambda, noam_lr)
    from .search import (DecodingModel, beam_search, gnmt_length_penalty, greedy_search,  # noqa: F401
                         max_source_len, output_budget)
    from .transformer import Transformer, sinusoid_table  # noqa: F401
