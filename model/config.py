"""Model hyper-parameters (Vaswani et al., 2017, Table 3).

`ModelSizes` is the one definition of a Transformer's sizes (and their checks): the pipeline
config's ``[model]`` section is one (``pipeline.config.ModelSection``), and `ModelConfig` is one
plus the vocabulary. `SIZES` names the sizes the project measures against; `size_name` finds a
model's name in it.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any, Literal

# "sinusoid" (§3.5), "learned" positional embeddings (Table 3 row E, after Gehring et al.), or "rotary"
# positions (Su et al., 2021) that rotate the queries and keys of self-attention instead
Positional = Literal["sinusoid", "learned", "rotary"]
NormPosition = Literal["post", "pre"]  # model.norm_position
Norm = Literal["layernorm", "rmsnorm"]  # model.norm
FeedForwardKind = Literal["relu", "swiglu"]  # model.ffn


def _option(default: Any) -> Any:
    """A field for a row after the paper (docs/model.md): `default` is the paper's model, and a stage's
    cache key holds the field only when it is set otherwise (the pipeline's ``cache = "if_set"``,
    `pipeline.config.migrations.keyed_if_set`), so the keys of configs without it stay as they were."""
    return dataclasses.field(default=default, metadata={"cache": "if_set"})


@dataclass(kw_only=True)
class ModelSizes:
    """The Transformer's sizes and dropout, without the vocabulary. Defaults are "base" (Table 3)."""

    d_model: int = 512  # model width d_model (§3, Table 3 base)
    d_ff: int = 2048  # inner width of the position-wise feed-forward net d_ff (§3.3)
    n_heads: int = 8  # attention heads h (§3.2.2)
    # Per-head query/key and value widths; None = d_model / h = 64 (§3.2.2). Table 3 (A, B) varies
    # them. (A config file leaves them out for None: TOML has no None.)
    d_k: int | None = None
    d_v: int | None = None  # as d_k: the per-head value width
    n_encoder_layers: int = 6  # encoder stack depth N (§3.1)
    n_decoder_layers: int = 6  # decoder stack depth N (§3.1)
    dropout: float = 0.1  # residual + embedding dropout P_drop (§5.4)
    max_positions: int = 1024  # sinusoid table length; must cover the longest source + 50 (§6.1)
    positional: Positional = "sinusoid"  # Table 3 row E: "learned"; "rotary" (Su et al., 2021): q, k rotated
    # "post": Norm(x + Sublayer(x)) (§3.1); "pre": x + Sublayer(Norm(x)) and a final norm after each
    # stack (Xiong et al., 2020)
    norm_position: NormPosition = _option("post")
    # "layernorm" (§3.1) or "rmsnorm" (Zhang & Sennrich, 2019): x / RMS(x) * g, no mean, no bias
    norm: Norm = _option("layernorm")
    # "relu": max(0, x W1 + b1) W2 + b2 (§3.3); "swiglu" (Shazeer, 2020): (silu(x W1 + b1) * (x W3 + b3)) W2 + b2,
    # d_ff the width of both W1 and W3 (+ d_model * d_ff + d_ff parameters per layer)
    ffn: FeedForwardKind = _option("relu")

    def check_sizes(self, prefix: str) -> None:
        """Types and values of the size fields; a TypeError/ValueError naming ``<prefix><field>``.
        A check, not a parser: strings from the command line are coerced by the config
        (`pipeline.config`) before they get here, and `model/` imports torch only."""
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(ModelSizes):
            _check_type(f"{prefix}{f.name}", getattr(self, f.name), hints[f.name])
        for name in ("d_model", "d_ff", "n_heads", "n_encoder_layers", "n_decoder_layers", "max_positions"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{prefix}{name} must be positive, got {getattr(self, name)}")
        for name in ("d_k", "d_v"):
            value = getattr(self, name)
            if value is None and self.d_model % self.n_heads != 0:
                raise ValueError(f"{prefix}d_model ({self.d_model}) must be divisible by "
                                 f"{prefix}n_heads ({self.n_heads}) unless {prefix}{name} is given")
            if value is not None and value <= 0:
                raise ValueError(f"{prefix}{name} must be positive, got {value}")
        if self.positional == "rotary" and any(w % 2 for w in self.head_dims):
            raise ValueError(f"{prefix}positional = 'rotary' rotates pairs of head dimensions: d_k and d_v must be "
                             f"even, got {self.head_dims}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"{prefix}dropout must be in [0, 1), got {self.dropout}")

    @property
    def head_dims(self) -> tuple[int, int]:
        """(d_k, d_v): the per-head widths, d_model / h where not given (§3.2.2)."""
        return (self.d_k or self.d_model // self.n_heads, self.d_v or self.d_model // self.n_heads)


# The named sizes, by the fields that define them: Table 3's base and big (§6.1; big also has
# P_drop 0.3 on EN-DE, see `ModelConfig.big`), and the published Multi30k anchor's fairseq
# transformer_tiny (Wu et al., ACL 2021; arXiv 2105.14462).
SIZES: dict[str, dict[str, int]] = {
    "base": {"d_model": 512, "d_ff": 2048, "n_heads": 8, "n_encoder_layers": 6, "n_decoder_layers": 6},
    "big": {"d_model": 1024, "d_ff": 4096, "n_heads": 16, "n_encoder_layers": 6, "n_decoder_layers": 6},
    "tiny": {"d_model": 128, "d_ff": 256, "n_heads": 4, "n_encoder_layers": 4, "n_decoder_layers": 4},
}


def size_name(sizes: ModelSizes, among: typing.Iterable[str] = SIZES, keys: typing.Iterable[str] | None = None
              ) -> str | None:
    """The name in `SIZES` (one of `among`) whose fields (all of them, or only `keys`) `sizes`
    (a ModelConfig or the config's model section) has; None when none matches."""
    for name in among:
        wanted = SIZES[name] if keys is None else {k: SIZES[name][k] for k in keys}
        if all(getattr(sizes, k) == v for k, v in wanted.items()):
            return name
    return None


@dataclass(kw_only=True)
class ModelConfig(ModelSizes):
    """Hyper-parameters of the encoder-decoder Transformer: `ModelSizes` (defaults "base",
    Table 3) and the vocabulary."""

    vocab_size: int  # shared source/target BPE vocabulary, ~37000 for WMT14 EN-DE (§5.1)
    pad_id: int = 0  # our SentencePiece model: pad=0, unk=1, bos=2, eos=3
    bos_id: int = 2  # first decoder input token (decoder input = [bos] + pieces)
    eos_id: int = 3  # ends source and target (source = pieces + [eos])
    tie_embeddings: bool = True  # one matrix for src emb, tgt emb and pre-softmax proj (§3.4)

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for name in ("vocab_size", "pad_id", "bos_id", "eos_id", "tie_embeddings"):
            _check_type(f"ModelConfig.{name}", getattr(self, name), hints[name])
        if self.vocab_size <= 0:
            raise ValueError(f"ModelConfig.vocab_size must be positive, got {self.vocab_size}")
        self.check_sizes("ModelConfig.")
        self.dropout = float(self.dropout)
        for name in ("pad_id", "bos_id", "eos_id"):
            value = getattr(self, name)
            if not 0 <= value < self.vocab_size:
                raise ValueError(f"ModelConfig.{name}={value} must be in [0, vocab_size={self.vocab_size})")
        if len({self.pad_id, self.bos_id, self.eos_id}) != 3:
            raise ValueError("ModelConfig.pad_id, bos_id and eos_id must be distinct, got "
                             f"{self.pad_id}, {self.bos_id}, {self.eos_id}")

    @classmethod
    def of(cls, sizes: ModelSizes, vocab_size: int, **ids: Any) -> "ModelConfig":
        """`sizes` (e.g. the config's model section) with a vocabulary: `vocab_size` and the
        special ids in `ids` (pad_id, bos_id, eos_id; tie_embeddings)."""
        return cls(**{f.name: getattr(sizes, f.name) for f in dataclasses.fields(ModelSizes)},
                   vocab_size=vocab_size, **ids)

    @classmethod
    def base(cls, vocab_size: int, **overrides: Any) -> "ModelConfig":
        """Transformer base (Table 3): d_model 512, d_ff 2048, h 8, P_drop 0.1, ~63M params at 37k vocab."""
        return cls.from_dict({"vocab_size": vocab_size, **SIZES["base"], **overrides})

    @classmethod
    def big(cls, vocab_size: int, **overrides: Any) -> "ModelConfig":
        """Transformer big (Table 3): d_model 1024, d_ff 4096, h 16, P_drop 0.3 (EN-DE; §6.1)."""
        return cls.from_dict({"vocab_size": vocab_size, **SIZES["big"], "dropout": 0.3, **overrides})

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


def _check_type(key: str, value: Any, annotation: Any) -> None:
    """Reject wrong types by field name (bools are not ints; ints are fine for floats), and a
    ``Literal`` field's value outside its allowed values (a ValueError)."""
    if typing.get_origin(annotation) is Literal:
        if value not in typing.get_args(annotation):
            raise ValueError(f"{key} must be one of {', '.join(map(repr, typing.get_args(annotation)))}, "
                             f"got {value!r}")
        return
    declared = typing.get_args(annotation) or (annotation,)  # `int | None` -> (int, NoneType)
    allowed = declared + ((int,) if float in declared else ())
    if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in declared):
        spelled = " | ".join("None" if t is type(None) else t.__name__ for t in declared)
        raise TypeError(f"{key} must be {spelled}, got {type(value).__name__} {value!r}")
