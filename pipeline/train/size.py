"""A model's size from the config: its `ModelConfig`, and its parameter count without allocating it.

`model_config_for` is the one place where the config's `model` section and the vocab stage's
outputs become a `ModelConfig` (the train stage, --plan, Table 3). `num_parameters` builds the
Transformer on PyTorch's ``meta`` device: real modules, real shapes, no memory, so the count is
the one the train stage's model has (at ``vocab.size`` pieces; the vocab stage's model has exactly
that many unless SentencePiece could not reach it).
"""

from __future__ import annotations

from typing import Any

import torch

from model import ModelConfig, Transformer
from pipeline.config import Config


def model_config_for(cfg: Config, vocab: dict[str, Any]) -> ModelConfig:
    """`cfg.model` sizes + the vocabulary's size and special ids (from the vocab stage)."""
    return ModelConfig.of(cfg.model, int(vocab["vocab_size"]), pad_id=int(vocab.get("pad_id", 0)),
                          bos_id=int(vocab.get("bos_id", 2)), eos_id=int(vocab.get("eos_id", 3)))


def num_parameters(cfg: Config, vocab_size: int | None = None) -> int:
    """Trainable parameters (the tied embedding counted once) of ``cfg.model`` at ``vocab_size``."""
    mc = model_config_for(cfg, {"vocab_size": vocab_size or cfg.vocab.size})
    with torch.device("meta"):
        return Transformer(mc).num_parameters()
