"""Transformer (Vaswani et al., 2017) for WMT14 EN-DE: architecture, loss, schedule, search.

transformer   the architecture as §3 writes it: `Transformer(cfg, cpu_kernels=True)`;
              `model(src, tgt_in, nonpad=None)` -> decoder output, `model.logits(h)` -> logits
padding       real (non-pad) positions (`Positions`, `NonPad`) and the padding mask
kernels       CPU dropout, fp32 CPU attention for bf16 gradients, in-place residual adds
heads         per-head widths when d_k, d_v differ from d_model / h (Table 3 A, B)
incremental   decoding one token at a time: `DecoderState`, the fused eval-mode decoder step
search        greedy and beam search over the `DecodingModel` protocol
attention_weights  the attention maps of a sentence pair (the paper's Figures 3-5)
loss, schedule, averaging, config: label smoothing, the learning rate, checkpoint averaging, sizes

Imports torch and the standard library only.
"""

from .averaging import average_checkpoints
from .config import SIZES, ModelConfig, ModelSizes, Positional, size_name
from .incremental import DecoderState
from .loss import label_smoothed_nll, linear_label_smoothed_nll
from .padding import NonPad
from .schedule import ADAM_BETAS, ADAM_EPS, make_optimizer, make_scheduler, noam_lambda, noam_lr
from .search import DecodingModel, beam_search, gnmt_length_penalty, greedy_search, max_source_len, output_budget
from .transformer import Transformer, sinusoid_table

__all__ = [
    "ADAM_BETAS", "ADAM_EPS", "DecoderState", "DecodingModel", "ModelConfig", "ModelSizes", "NonPad", "Positional",
    "SIZES", "Transformer", "average_checkpoints",
    "beam_search", "gnmt_length_penalty", "greedy_search", "label_smoothed_nll", "linear_label_smoothed_nll", "make_optimizer",
    "make_scheduler", "max_source_len", "noam_lambda", "noam_lr", "output_budget", "sinusoid_table", "size_name",
]
