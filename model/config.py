"""Model hyper-parameters (Vaswani et al., 2017, Table 3)."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any


@dataclass
class ModelConfig:
    """Hyper-parameters of the encoder-decoder Transformer. Defaults are "base" (Table 3)."""

    vocab_size: int  # shared source/target BPE vocabulary, ~37000 for WMT14 EN-DE (§5.1)
    pad_id: int = 0  # our SentencePiece model: pad=0, unk=1, bos=2, eos=3
    bos_id: int = 2  # first decoder input token (decoder input = [bos] + pieces)
    eos_id: int = 3  # ends source and target (source = pieces + [eos])
    d_model: int = 512  # model width d_model (§3, Table 3 base)
    d_ff: int = 2048  # inner width of the position-wise feed-forward net d_ff (§3.3)
    n_heads: int = 8  # attention heads h (§3.2.2)
    # Per-head query/key and value widths; None = d_model / h = 64 (§3.2.2). Table 3 (A, B) varies them.
    d_k: int | None = None
    d_v: int | None = None
    n_encoder_layers: int = 6  # encoder stack depth N (§3.1)
    n_decoder_layers: int = 6  # decoder stack depth N (§3.1)
    dropout: float = 0.1  # residual + embedding dropout P_drop (§5.4)
    max_positions: int = 1024  # sinusoid table length; must cover the longest source + 50 (§6.1)
    tie_embeddings: bool = True  # one matrix for src emb, tgt emb and pre-softmax proj (§3.4)
    # "sinusoid" (§3.5) or "learned" positional embeddings (Table 3 row E, after Gehring et al.)
    positional: str = "sinusoid"

    def __post_init__(self) -> None:
        for name, annotation in typing.get_type_hints(type(self)).items():
            _check_type(name, getattr(self, name), annotation)
        self.dropout = float(self.dropout)
        for name in ("vocab_size", "d_model", "d_ff", "n_heads", "n_encoder_layers",
                     "n_decoder_layers", "max_positions"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
        for name in ("d_k", "d_v"):
            value = getattr(self, name)
            if value is None and self.d_model % self.n_heads != 0:
                raise ValueError(f"ModelConfig.d_model ({self.d_model}) must be divisible by "
                                 f"ModelConfig.n_heads ({self.n_heads}) unless ModelConfig.{name} is given")
            if value is not None and value <= 0:
                raise ValueError(f"ModelConfig.{name} must be positive, got {value}")
        if self.positional not in ("sinusoid", "learned"):
            raise ValueError(f"ModelConfig.positional must be 'sinusoid' or 'learned', got {self.positional!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"ModelConfig.dropout must be in [0, 1), got {self.dropout}")
        for name in ("pad_id", "bos_id", "eos_id"):
            value = getattr(self, name)
            if not 0 <= value < self.vocab_size:
                raise ValueError(f"ModelConfig.{name}={value} must be in [0, vocab_size={self.vocab_size})")
        if len({self.pad_id, self.bos_id, self.eos_id}) != 3:
            raise ValueError("ModelConfig.pad_id, bos_id and eos_id must be distinct, got "
                             f"{self.pad_id}, {self.bos_id}, {self.eos_id}")

    @classmethod
    def base(cls, vocab_size: int, **overrides: Any) -> "ModelConfig":
        """Transformer base (Table 3): d_model 512, d_ff 2048, h 8, P_drop 0.1, ~63M params at 37k vocab."""
        return cls.from_dict({"vocab_size": vocab_size, **overrides})

    @classmethod
    def big(cls, vocab_size: int, **overrides: Any) -> "ModelConfig":
        """Transformer big (Table 3): d_model 1024, d_ff 4096, h 16, P_drop 0.3 (EN-DE; §6.1)."""
        big = {"d_model": 1024, "d_ff": 4096, "n_heads": 16, "dropout": 0.3}
        return cls.from_dict({"vocab_size": vocab_size, **big, **overrides})

    @property
    def head_dims(self) -> tuple[int, int]:
        """(d_k, d_v): the per-head widths, d_model / h where not given (§3.2.2)."""
        return (self.d_k or self.d_model // self.n_heads, self.d_v or self.d_model // self.n_heads)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict of all fields."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        """Inverse of `to_dict`; unknown keys are an error naming them."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown ModelConfig key(s): {', '.join(unknown)}")
        return cls(**d)


def _check_type(name: str, value: Any, annotation: Any) -> None:
    """Reject wrong types by field name (bools are not ints; ints are fine for floats). A check,
    not a parser: strings from the command line are coerced by the config (`pipeline.config`)
    before they get here, and `model/` imports torch only."""
    declared = typing.get_args(annotation) or (annotation,)  # `int | None` -> (int, NoneType)
    allowed = declared + ((int,) if float in declared else ())
    if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in declared):
        spelled = " | ".join("None" if t is type(None) else t.__name__ for t in declared)
        raise TypeError(f"ModelConfig.{name} must be {spelled}, got {type(value).__name__} {value!r}")
