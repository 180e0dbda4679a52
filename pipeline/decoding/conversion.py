"""Model conversion: our Transformer as a Hugging Face ``MarianMTModel`` folder and CTranslate2 models.

Used by the ``export`` stage (``pipeline/serve/export.py``, the averaged model) and by dev BLEU
(``pipeline/decoding/dev_bleu.py``, each checkpoint converted for CTranslate2).

The mapping is exact, not approximate. Our block (model/transformer.py) and Marian's are the
same post-norm Transformer (§3.1: LayerNorm(x + Sublayer(x)), ReLU FFN, biases in every
projection, LayerNorm eps 1e-5, embeddings * sqrt(d_model), one matrix for both embeddings and
the pre-softmax projection). They differ in one place only, the sinusoid table (§3.5): ours
interleaves (PE[:, 2i] = sin, PE[:, 2i+1] = cos), Marian's puts [sin | cos] in two halves. The
permutation ``perm = [0, 2, 4, ..., 1, 3, 5, ...]`` of the model dimension maps ours onto
Marian's; applied to every tensor that reads or writes the residual stream (embedding columns,
the input columns of projections that read it, the output rows and biases of those that write
it, LayerNorm gains and biases) it turns our network into one whose hidden states are ours
permuted, and whose logits are ours exactly: LayerNorm and ReLU act element-wise or on
permutation-invariant statistics, attention heads live in their own (unpermuted) space, and
the tied output projection h . E^T is unchanged when h and E's columns move together.

Token ids are ours: pad 0, unk 1, bos 2 (the decoder start token: decoder input = [bos] +
pieces), eos 3 ends sources and targets. Marian's usual convention (pad as decoder start, the
last id as pad) is not assumed anywhere: the config names our ids, and CTranslate2's own
Marian loader (which starts the decoder from a zero embedding and drops a trailing <pad>) is
not used; ``_PostNormLoader`` drives CTranslate2's BART loader, which maps the same modules
without those two Marian assumptions.

``export_all`` writes under a folder: ``hf/`` (config.json, generation_config.json,
model.safetensors, MarianTokenizer's source.spm, target.spm, vocab.json, tokenizer_config.json),
``ct2-float32/`` and ``ct2-int8/`` (model.bin, config.json, shared_vocabulary.json).

The options after 2017 (pre-norm, RMSNorm, SwiGLU, rotary positions) are not Marian's blocks:
``unexportable`` names the one a model sets, and its CTranslate2 models are built from our weights
instead (``ct2_spec``, ``export_ct2_spec``), with no ``hf/``. ``ct2_unexportable`` says whether
either route holds a model.
"""

from __future__ import annotations

import json
import logging
import tempfile
import typing
from pathlib import Path
from typing import Any

import torch

from model import ModelConfig
from pipeline.config import Quantization
from pipeline.decoding import ct2_spec

log = logging.getLogger(__name__)

CT2_QUANTIZATIONS = typing.get_args(Quantization)


def marian_permutation(d_model: int) -> torch.Tensor:
    """perm (d,) long with ``marian[..., j] = ours[..., perm[j]]``: sin columns first, then cos."""
    return torch.cat([torch.arange(0, d_model, 2), torch.arange(1, d_model, 2)])


def _linear(prefix: str, weight: torch.Tensor, bias: torch.Tensor, perm: torch.Tensor,
            reads: bool, writes: bool) -> dict[str, torch.Tensor]:
    """A Linear's (out, in) weight and bias, permuted on the sides that touch the residual stream."""
    if reads:
        weight = weight[:, perm]
    if writes:
        weight, bias = weight[perm], bias[perm]
    return {f"{prefix}.weight": weight.contiguous(), f"{prefix}.bias": bias.contiguous()}


def _norm(prefix: str, state: dict[str, torch.Tensor], ours: str, perm: torch.Tensor) -> dict[str, torch.Tensor]:
    return {f"{prefix}.weight": state[f"{ours}.weight"][perm].contiguous(),
            f"{prefix}.bias": state[f"{ours}.bias"][perm].contiguous()}


def _attention(prefix: str, state: dict[str, torch.Tensor], ours: str, perm: torch.Tensor,
               d: int, fused_qkv: bool) -> dict[str, torch.Tensor]:
    """Our fused projections ([Q;K;V] for self-attention, q + [K;V] for cross-attention) split into
    Marian's q/k/v_proj; heads keep their order, so only the residual-side columns move."""
    if fused_qkv:
        w, b = state[f"{ours}.qkv_proj.weight"], state[f"{ours}.qkv_proj.bias"]
        parts = {"q": (w[:d], b[:d]), "k": (w[d:2 * d], b[d:2 * d]), "v": (w[2 * d:], b[2 * d:])}
    else:
        w, b = state[f"{ours}.kv_proj.weight"], state[f"{ours}.kv_proj.bias"]
        parts = {"q": (state[f"{ours}.q_proj.weight"], state[f"{ours}.q_proj.bias"]),
                 "k": (w[:d], b[:d]), "v": (w[d:], b[d:])}
    out: dict[str, torch.Tensor] = {}
    for name, (pw, pb) in parts.items():
        out.update(_linear(f"{prefix}.{name}_proj", pw, pb, perm, reads=True, writes=False))
    out.update(_linear(f"{prefix}.out_proj", state[f"{ours}.out_proj.weight"], state[f"{ours}.out_proj.bias"],
                       perm, reads=False, writes=True))
    return out


def _ffn(prefix: str, state: dict[str, torch.Tensor], ours: str, perm: torch.Tensor) -> dict[str, torch.Tensor]:
    return {**_linear(f"{prefix}.fc1", state[f"{ours}.w1.weight"], state[f"{ours}.w1.bias"], perm, True, False),
            **_linear(f"{prefix}.fc2", state[f"{ours}.w2.weight"], state[f"{ours}.w2.bias"], perm, False, True)}


def unexportable(cfg: ModelConfig) -> str | None:
    """Why Marian cannot hold this model exactly; None if it can (the paper's model)."""
    head = cfg.d_model // cfg.n_heads
    if cfg.head_dims != (head, head):
        return f"d_k/d_v = {cfg.head_dims} differ from d_model/h = {head} (Table 3 rows A/B): Marian has no such heads"
    if cfg.positional == "learned":
        return "learned positional embeddings (Table 3 row E): Marian's positions are sinusoids only"
    if not cfg.tie_embeddings:
        return "untied embeddings: Marian shares one matrix (§3.4, our default)"
    later = ct2_spec.options_set(cfg)
    if later:
        return (f"{', '.join(later)}: Marian's blocks are post-norm LayerNorm with a ReLU FFN and added "
                "sinusoids only")
    return None


def ct2_unexportable(cfg: ModelConfig) -> str | None:
    """Why no CTranslate2 model of this one is exported; None if one is: through Marian (the paper's
    model) or, for a model with an option after 2017, from a spec of our weights (`ct2_spec`). A
    model without such an option that Marian cannot hold (Table 3 rows A, B, E, untied embeddings)
    keeps its refusal, so those runs decode dev BLEU with our beam search as they always have."""
    marian = unexportable(cfg)
    if marian is None or not ct2_spec.options_set(cfg):
        return marian
    return ct2_spec.unholdable(cfg)


def to_marian_state_dict(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our ``Transformer.state_dict()`` -> ``MarianMTModel`` parameter names and layouts (see module doc)."""
    if not cfg.tie_embeddings:
        raise ValueError("export: only tied embeddings (§3.4, our default) map onto Marian's shared matrix")
    d, perm = cfg.d_model, marian_permutation(cfg.d_model)
    state = {k: v.detach().float().cpu() for k, v in state.items()}
    out = {"model.shared.weight": state["src_embed.weight"][:, perm].contiguous(),
           "final_logits_bias": torch.zeros(1, cfg.vocab_size)}
    for i in range(cfg.n_encoder_layers):
        ours, hf = f"encoder_layers.{i}", f"model.encoder.layers.{i}"
        out.update(_attention(f"{hf}.self_attn", state, f"{ours}.self_attn", perm, d, fused_qkv=True))
        out.update(_norm(f"{hf}.self_attn_layer_norm", state, f"{ours}.norm1", perm))
        out.update(_ffn(hf, state, f"{ours}.ffn", perm))
        out.update(_norm(f"{hf}.final_layer_norm", state, f"{ours}.norm2", perm))
    for i in range(cfg.n_decoder_layers):
        ours, hf = f"decoder_layers.{i}", f"model.decoder.layers.{i}"
        out.update(_attention(f"{hf}.self_attn", state, f"{ours}.self_attn", perm, d, fused_qkv=True))
        out.update(_norm(f"{hf}.self_attn_layer_norm", state, f"{ours}.norm1", perm))
        out.update(_attention(f"{hf}.encoder_attn", state, f"{ours}.cross_attn", perm, d, fused_qkv=False))
        out.update(_norm(f"{hf}.encoder_attn_layer_norm", state, f"{ours}.norm2", perm))
        out.update(_ffn(hf, state, f"{ours}.ffn", perm))
        out.update(_norm(f"{hf}.final_layer_norm", state, f"{ours}.norm3", perm))
    return out


def marian_config(cfg: ModelConfig) -> Any:
    """A ``MarianConfig`` for our architecture and ids (dropout where ours has it: residual + embeddings)."""
    from transformers import MarianConfig

    return MarianConfig(
        vocab_size=cfg.vocab_size, decoder_vocab_size=cfg.vocab_size, d_model=cfg.d_model,
        encoder_layers=cfg.n_encoder_layers, decoder_layers=cfg.n_decoder_layers,
        encoder_attention_heads=cfg.n_heads, decoder_attention_heads=cfg.n_heads,
        encoder_ffn_dim=cfg.d_ff, decoder_ffn_dim=cfg.d_ff, activation_function="relu",
        max_position_embeddings=cfg.max_positions, dropout=cfg.dropout, attention_dropout=0.0,
        activation_dropout=0.0, scale_embedding=True, share_encoder_decoder_embeddings=True,
        tie_word_embeddings=True, pad_token_id=cfg.pad_id, bos_token_id=cfg.bos_id, eos_token_id=cfg.eos_id,
        decoder_start_token_id=cfg.bos_id, forced_eos_token_id=cfg.eos_id, is_encoder_decoder=True)


def generation_defaults(cfg: ModelConfig) -> dict[str, Any]:
    """``generate()`` defaults closest to our search (§6.1 beam 4): pad and bos are never produced,
    eos is forced at the length limit. Length penalty: HF divides log P by |Y|^0.6, not by GNMT's
    ((5 + |Y|) / 6)^0.6, and has no "source length + 50" limit (``max_new_tokens`` is per call)."""
    return {"num_beams": 4, "length_penalty": 0.6, "suppress_tokens": [cfg.pad_id, cfg.bos_id],
            "forced_eos_token_id": cfg.eos_id, "decoder_start_token_id": cfg.bos_id,
            "bos_token_id": cfg.bos_id, "eos_token_id": cfg.eos_id, "pad_token_id": cfg.pad_id,
            "max_length": cfg.max_positions}


def write_tokenizer(spm_path: str, folder: Path, max_positions: int) -> None:
    """MarianTokenizer files from our SentencePiece model: the same model as source.spm and
    target.spm, and vocab.json = piece -> our id (Marian's vocab is not SentencePiece's order in
    general; here it is, so ids round-trip)."""
    import sentencepiece as spm
    from transformers import MarianTokenizer

    sp = spm.SentencePieceProcessor(model_file=spm_path)
    with tempfile.TemporaryDirectory() as tmp:
        vocab = Path(tmp) / "vocab.json"
        vocab.write_text(json.dumps({sp.id_to_piece(i): i for i in range(sp.get_piece_size())}, ensure_ascii=False),
                         encoding="utf-8")
        tok = MarianTokenizer(source_spm=spm_path, target_spm=spm_path, vocab=str(vocab), source_lang="en",
                              target_lang="de", unk_token=sp.id_to_piece(sp.unk_id()),
                              eos_token=sp.id_to_piece(sp.eos_id()), pad_token=sp.id_to_piece(sp.pad_id()),
                              model_max_length=max_positions)
        tok.save_pretrained(str(folder))


def export_hf(state: dict[str, torch.Tensor], cfg: ModelConfig, spm_path: str, folder: Path) -> None:
    """Write a folder that ``MarianMTModel.from_pretrained(folder)`` and ``MarianTokenizer`` load offline."""
    from transformers import GenerationConfig, MarianMTModel

    hf = MarianMTModel(marian_config(cfg))
    missing, unexpected = hf.load_state_dict(to_marian_state_dict(state, cfg), strict=False)
    # The positional tables are a function of the config (not saved by HF either); the tied
    # embedding copies share model.shared.
    allowed = {"model.encoder.embed_positions.weight", "model.decoder.embed_positions.weight",
               "model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight", "lm_head.weight"}
    if unexpected or set(missing) - allowed:
        raise RuntimeError(f"export: Marian mapping mismatch: missing {sorted(set(missing) - allowed)}, "
                           f"unexpected {sorted(unexpected)}")
    hf.generation_config = GenerationConfig(**generation_defaults(cfg))
    hf.save_pretrained(str(folder), safe_serialization=True)
    write_tokenizer(spm_path, folder, cfg.max_positions)


def export_ct2(hf_folder: Path, out: Path, quantization: str) -> None:
    """A CTranslate2 model from the Marian folder, via CTranslate2's model-spec API."""
    _ct2_converter(hf_folder).convert(str(out), quantization=quantization, force=True)


def export_ct2_spec(state: dict[str, torch.Tensor], cfg: ModelConfig, spm_path: str, out: Path,
                    quantization: str) -> None:
    """A CTranslate2 model of a model Marian cannot hold, from a spec of our weights (`ct2_spec`);
    its vocabulary is our SentencePiece model's pieces in id order, as the Marian folder's."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=spm_path)
    tokens = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    ct2_spec.export(state, cfg, tokens, sp.id_to_piece(sp.unk_id()), out, quantization)


def _ct2_converter(hf_folder: Path) -> Any:
    """A ``ctranslate2.converters.Converter`` whose spec CTranslate2's BART loader fills from our
    Marian folder (same modules; see the module doc for why not its Marian loader)."""
    import transformers
    from ctranslate2.converters.converter import Converter
    from ctranslate2.converters.transformers import BartLoader

    class _PostNormLoader(BartLoader):
        def get_model_spec(self, model):
            model.config.normalize_before = False  # post-norm (§3.1)
            model.config.normalize_embedding = False  # no LayerNorm on the embeddings
            return super().get_model_spec(model)

        def set_config(self, config, model, tokenizer):
            config.bos_token = tokenizer.convert_ids_to_tokens(model.config.bos_token_id)
            config.eos_token = tokenizer.eos_token
            config.unk_token = tokenizer.unk_token
            config.decoder_start_token = tokenizer.convert_ids_to_tokens(model.config.decoder_start_token_id)
            config.layer_norm_epsilon = 1e-5  # torch's default, ours and Marian's

    class _Converter(Converter):
        def _load(self):
            model = transformers.MarianMTModel.from_pretrained(str(hf_folder))
            tokenizer = transformers.MarianTokenizer.from_pretrained(str(hf_folder))
            with torch.no_grad():
                return _PostNormLoader()(model, tokenizer)

    return _Converter()


def export_all(model_path: str, model_config: dict[str, Any], spm_path: str, out_dir: Path) -> dict[str, str]:
    """The HF folder (where Marian holds the model) and one CTranslate2 model per quantization under
    ``out_dir``; their paths."""
    cfg = ModelConfig.from_dict(model_config)
    state = torch.load(model_path, weights_only=True, map_location="cpu")
    paths = {}
    if unexportable(cfg) is None:  # the paper's model: the Marian folder, and CTranslate2 from it
        paths["hf"] = out_dir / "hf"
        export_hf(state, cfg, spm_path, paths["hf"])
    for q in CT2_QUANTIZATIONS:
        paths[f"ct2_{q}"] = out_dir / f"ct2-{q}"
        if "hf" in paths:
            export_ct2(paths["hf"], paths[f"ct2_{q}"], q)
        else:  # an option after 2017
            export_ct2_spec(state, cfg, spm_path, paths[f"ct2_{q}"], q)
    return {k: str(v) for k, v in paths.items()}
