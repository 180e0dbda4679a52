"""A model's parameter count from the config alone, without allocating it (for --plan, Table 3).

The Transformer is built on PyTorch's ``meta`` device: real modules, real shapes, no memory, so
the count is the one the train stage's model has (at ``vocab.size`` pieces; the vocab stage's
model has exactly that many unless SentencePiece could not reach it).
"""

from __future__ import annotations

import torch

from model import Transformer
from pipeline.config import Config
from pipeline.train.stage import model_config_for


def num_parameters(cfg: Config, vocab_size: int | None = None) -> int:
    """Trainable parameters (the tied embedding counted once) of ``cfg.model`` at ``vocab_size``."""
    mc = model_config_for(cfg, {"vocab_size": vocab_size or cfg.vocab.size})
    with torch.device("meta"):
        return Transformer(mc).num_parameters()
