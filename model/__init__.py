"""Transformer (Vaswani et al., 2017) for WMT14 EN-DE: architecture, loss, schedule, search.

Imports torch and the standard library only.
"""

from .averaging import average_checkpoints
from .config import SIZES, ModelConfig, ModelSizes, Positional, size_name
from .loss import label_smoothed_nll, linear_label_smoothed_nll
from .schedule import ADAM_BETAS, ADAM_EPS, make_optimizer, make_scheduler, noam_lambda, noam_lr
from .search import DecodingModel, beam_search, gnmt_length_penalty, greedy_search, max_source_len, output_budget
from .transformer import DecoderState, Transformer, sinusoid_table

__all__ = [
    "ADAM_BETAS", "ADAM_EPS", "DecoderState", "DecodingModel", "ModelConfig", "ModelSizes", "Positional", "SIZES",
    "Transformer", "average_checkpoints",
    "beam_search", "gnmt_length_penalty", "greedy_search", "label_smoothed_nll", "linear_label_smoothed_nll", "make_optimizer",
    "make_scheduler", "max_source_len", "noam_lambda", "noam_lr", "output_budget", "sinusoid_table", "size_name",
]
