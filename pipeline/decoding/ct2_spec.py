"""Our Transformer as CTranslate2's ``TransformerSpec``, filled straight from its state dict: the
CTranslate2 export of the options after 2017 (``model.norm_position``, ``model.norm``,
``model.ffn``, ``model.positional = "rotary"``), which Marian cannot hold (``conversion.unexportable``).
The paper's model keeps the Marian route (``conversion.export_ct2``), unchanged.

The spec is CTranslate2's own encoder-decoder Transformer (ctranslate2/specs/transformer_spec.py),
and each option has its switch there: ``pre_norm`` (a norm before each sublayer, and a final one
after each stack, as ours), ``rms_norm`` (a gain, no bias), ``ffn_glu`` with the SWISH activation
(its linear_0 is our gated W1, linear_0_noact our W3, linear_1 our W2), and ``rotary_dim = 0``
(every head dimension) with ``rotary_interleave`` (pairs (x_2i, x_2i+1), as ours) on
self-attention only. Our weights go in unpermuted: the fused [W_Q; W_K; W_V] is self-attention's
linear[0], cross-attention's W_Q and [W_K; W_V] are its linear[0] and linear[1]. Positions: our §3.5
sinusoid table (interleaved; CTranslate2's built-in table is another) or the learned one as the
spec's encodings, none for rotary. CTranslate2 takes one epsilon for all its norms: ours, 1e-5.
What it cannot hold: d_k != d_v (it has one head width for queries, keys and values).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch

from model import ModelConfig, sinusoid_table

# The options after 2017 at the paper's values (model/config.py); positional is one too at "rotary".
PAPER = {"norm_position": "post", "norm": "layernorm", "ffn": "relu"}


def options_set(cfg: ModelConfig) -> list[str]:
    """The options after 2017 that `cfg` sets, as ``model.<key> = <value>``; [] for the paper's model."""
    out = ["model.positional = 'rotary'"] if cfg.positional == "rotary" else []
    return out + [f"model.{k} = {getattr(cfg, k)!r}" for k, paper in PAPER.items() if getattr(cfg, k) != paper]


def unholdable(cfg: ModelConfig) -> str | None:
    """Why CTranslate2's TransformerSpec cannot hold this model; None if it can."""
    d_k, d_v = cfg.head_dims
    if d_k != d_v:
        return f"d_k/d_v = {cfg.head_dims} differ: CTranslate2's attention has one head width for q, k and v"
    return None


def build(state: dict[str, torch.Tensor], cfg: ModelConfig, tokens: Sequence[str], unk_token: str) -> Any:
    """A validated-ready ``TransformerSpec`` of our ``Transformer.state_dict()`` with vocabulary
    `tokens` (piece of each id, ours) and its unknown-token piece."""
    from ctranslate2.specs import common_spec, transformer_spec

    why = unholdable(cfg)
    if why:
        raise ValueError(f"CTranslate2 export: {why}")
    if len(tokens) != cfg.vocab_size:
        raise ValueError(f"CTranslate2 export: {len(tokens)} tokens for a vocabulary of {cfg.vocab_size}")
    state = {k: v.detach().float().cpu() for k, v in state.items()}
    head = cfg.head_dims[0]
    switches = dict(pre_norm=cfg.norm_position == "pre", rms_norm=cfg.norm == "rmsnorm", ffn_glu=cfg.ffn == "swiglu",
                    activation=common_spec.Activation.SWISH if cfg.ffn == "swiglu" else common_spec.Activation.RELU,
                    head_dim=None if head * cfg.n_heads == cfg.d_model else head,
                    rotary_dim=0 if cfg.positional == "rotary" else None, rotary_interleave=True)
    spec = transformer_spec.TransformerSpec(
        transformer_spec.TransformerEncoderSpec(cfg.n_encoder_layers, cfg.n_heads, **switches),
        transformer_spec.TransformerDecoderSpec(cfg.n_decoder_layers, cfg.n_heads, **switches))
    _fill_encoder(spec.encoder, state, cfg)
    _fill_decoder(spec.decoder, state, cfg)
    spec.decoder.projection.weight = state["output_proj.weight"]
    c = spec.config
    c.bos_token = c.decoder_start_token = tokens[cfg.bos_id]  # decoder input = [bos] + pieces
    c.eos_token, c.unk_token, c.layer_norm_epsilon = tokens[cfg.eos_id], unk_token, 1e-5  # torch's default, ours
    spec.register_source_vocabulary(list(tokens))
    spec.register_target_vocabulary(list(tokens))
    return spec


def export(state: dict[str, torch.Tensor], cfg: ModelConfig, tokens: Sequence[str], unk_token: str, out: Path,
           quantization: str) -> None:
    """Write the CTranslate2 model folder `out` (model.bin, config.json, shared_vocabulary.json)."""
    from ctranslate2.converters.converter import Converter

    spec = build(state, cfg, tokens, unk_token)

    class _Spec(Converter):
        def _load(self) -> Any:
            return spec

    _Spec().convert(str(out), quantization=quantization, force=True)


def _linear(spec: Any, state: dict[str, torch.Tensor], name: str) -> None:
    spec.weight, spec.bias = state[f"{name}.weight"], state[f"{name}.bias"]


def _norm(spec: Any, state: dict[str, torch.Tensor], name: str, cfg: ModelConfig) -> None:
    spec.gamma = state[f"{name}.weight"]
    if cfg.norm == "layernorm":  # RMSNorm has a gain only
        spec.beta = state[f"{name}.bias"]


def _positions(spec: Any, state: dict[str, torch.Tensor], cfg: ModelConfig) -> None:
    if cfg.positional == "sinusoid":
        spec.position_encodings.encodings = sinusoid_table(cfg.max_positions, cfg.d_model)
    elif cfg.positional == "learned":
        spec.position_encodings.encodings = state["pos_embed.weight"]
    # rotary: nothing added to the embeddings (CTranslate2 skips its encodings when attention rotates)


def _ffn(spec: Any, state: dict[str, torch.Tensor], name: str, cfg: ModelConfig) -> None:
    _linear(spec.linear_0, state, f"{name}.w1")
    _linear(spec.linear_1, state, f"{name}.w2")
    if cfg.ffn == "swiglu":
        _linear(spec.linear_0_noact, state, f"{name}.w3")


def _self_attention(layer: Any, state: dict[str, torch.Tensor], ours: str, cfg: ModelConfig) -> None:
    """A layer's self-attention: the fused [W_Q; W_K; W_V], W_O and the norm of its sublayer."""
    _linear(layer.self_attention.linear[0], state, f"{ours}.self_attn.qkv_proj")
    _linear(layer.self_attention.linear[1], state, f"{ours}.self_attn.out_proj")
    _norm(layer.self_attention.layer_norm, state, f"{ours}.norm1", cfg)


def _final_norm(spec: Any, state: dict[str, torch.Tensor], name: str, cfg: ModelConfig) -> None:
    """Pre-norm's norm after the stack (none after a post-norm stack)."""
    if cfg.norm_position == "pre":
        _norm(spec.layer_norm, state, name, cfg)


def _fill_encoder(spec: Any, state: dict[str, torch.Tensor], cfg: ModelConfig) -> None:
    spec.embeddings[0].weight = state["src_embed.weight"]
    _positions(spec, state, cfg)
    for i, layer in enumerate(spec.layer):
        ours = f"encoder_layers.{i}"
        _self_attention(layer, state, ours, cfg)
        _ffn(layer.ffn, state, f"{ours}.ffn", cfg)
        _norm(layer.ffn.layer_norm, state, f"{ours}.norm2", cfg)
    _final_norm(spec, state, "encoder_norm", cfg)


def _fill_decoder(spec: Any, state: dict[str, torch.Tensor], cfg: ModelConfig) -> None:
    spec.embeddings.weight = state["tgt_embed.weight"]
    _positions(spec, state, cfg)
    for i, layer in enumerate(spec.layer):
        ours = f"decoder_layers.{i}"
        _self_attention(layer, state, ours, cfg)
        _linear(layer.attention.linear[0], state, f"{ours}.cross_attn.q_proj")
        _linear(layer.attention.linear[1], state, f"{ours}.cross_attn.kv_proj")
        _linear(layer.attention.linear[2], state, f"{ours}.cross_attn.out_proj")
        _norm(layer.attention.layer_norm, state, f"{ours}.norm2", cfg)
        _ffn(layer.ffn, state, f"{ours}.ffn", cfg)
        _norm(layer.ffn.layer_norm, state, f"{ours}.norm3", cfg)
    _final_norm(spec, state, "decoder_norm", cfg)
