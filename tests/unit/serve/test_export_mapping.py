"""The Marian mapping on random weights, against transformers' own modules (fast, no files).

The trained-model round trips (HF logits, greedy ours = HF = CTranslate2, the stage, MLflow) are
in tests/integration/test_export.py.
"""

from __future__ import annotations

import pytest
import torch

from model import ModelConfig, Transformer, sinusoid_table
from pipeline.decoding.conversion import marian_config, marian_permutation, to_marian_state_dict

transformers = pytest.importorskip("transformers")


def test_the_permutation_maps_our_interleaved_table_onto_marians_halves():
    from transformers.models.marian.modeling_marian import MarianSinusoidalPositionalEmbedding

    for d in (8, 64):
        theirs = MarianSinusoidalPositionalEmbedding(50, d).create_weight()
        ours = sinusoid_table(50, d)
        assert not torch.allclose(ours, theirs)  # the layouts really differ
        torch.testing.assert_close(ours[:, marian_permutation(d)], theirs, atol=1e-6, rtol=0)


def _random_model() -> Transformer:
    cfg = ModelConfig(vocab_size=50, d_model=16, d_ff=24, n_heads=2, n_encoder_layers=2, n_decoder_layers=2,
                      max_positions=64, dropout=0.0)
    torch.manual_seed(0)
    model = Transformer(cfg)
    with torch.no_grad():  # LayerNorm gains/biases and projection biases start at 1 / 0: make them matter
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.3 * torch.randn_like(p))
    return model.eval()


def test_marian_logits_equal_ours_on_a_padded_batch():
    from transformers import MarianMTModel

    model = _random_model()
    cfg = model.cfg
    hf = MarianMTModel(marian_config(cfg))
    missing, unexpected = hf.load_state_dict(to_marian_state_dict(model.state_dict(), cfg), strict=False)
    assert not unexpected and all("embed_positions" in k or "embed_tokens" in k or k == "lm_head.weight"
                                  for k in missing)
    hf.eval()
    src = torch.tensor([[5, 9, 11, 7, 3], [6, 8, 3, 0, 0]])
    tgt = torch.tensor([[2, 14, 15, 16], [2, 17, 0, 0]])
    with torch.no_grad():
        ours = model.logits(model(src, tgt))
        theirs = hf(input_ids=src, attention_mask=src.ne(0), decoder_input_ids=tgt,
                    decoder_attention_mask=tgt.ne(0)).logits
    real = tgt.ne(0)
    torch.testing.assert_close(theirs[real], ours[real], atol=1e-5, rtol=0)
    assert hf.lm_head.weight.data_ptr() == hf.model.shared.weight.data_ptr()  # the three-way tie holds


def test_an_untied_model_is_refused_by_name():
    cfg = ModelConfig(vocab_size=20, d_model=8, d_ff=8, n_heads=2, n_encoder_layers=1, n_decoder_layers=1,
                      tie_embeddings=False)
    with pytest.raises(ValueError, match="tied embeddings"):
        to_marian_state_dict(Transformer(cfg).state_dict(), cfg)


def test_variants_marian_cannot_hold_are_named_not_exported():
    from model import ModelConfig
    from pipeline.decoding.conversion import unexportable

    base = dict(vocab_size=100, d_model=32, d_ff=64, n_heads=4, n_encoder_layers=1, n_decoder_layers=1)
    assert unexportable(ModelConfig(**base)) is None
    assert "d_k/d_v" in unexportable(ModelConfig(**base, d_k=16))
    assert "learned" in unexportable(ModelConfig(**base, positional="learned"))
    assert "untied" in unexportable(ModelConfig(**base, tie_embeddings=False))
