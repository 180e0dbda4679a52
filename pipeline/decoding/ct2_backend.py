"""CTranslate2 as `translate`'s decoding engine (``decode.backend = "ctranslate2"``): the fast path.

Runs the ``export`` stage's CTranslate2 model on the same inputs as our beam search (pieces +
eos as SentencePiece piece strings) and keeps what CTranslate2 lets us keep of its semantics:
beam size, the output budget a * |source| + b (``max_decoding_length`` per call, so sentences are
grouped by their budget), pad and bos never produced (``suppress_sequences``).

Deviation: CTranslate2's length penalty divides log P by |Y|^alpha, not GNMT's
((5 + |Y|) / 6)^alpha (§6.1 via Wu et al. 2016), and it stops a sentence once `beam_size`
hypotheses have finished, because those are its built-in rules; our beam search stays the
reference (``decode.backend = "torch"``). Greedy outputs are identical (tests/integration/test_export.py).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Any, Sequence

from model import output_budget

log = logging.getLogger(__name__)


class CT2Engine:
    """Loads a CTranslate2 model once; translates lists of our token ids to lists of token ids."""

    def __init__(self, model_dir: str, sp: Any, cfg: Any, settings: Any, device: str = "cpu",
                 num_threads: int = 0):
        """``cfg``: the model's ``ModelConfig`` (positions and ids); ``settings``: a ``DecodeSettings``."""
        import ctranslate2

        self.sp, self.settings = sp, settings
        self.max_positions = cfg.max_positions
        # int8 weights run int8 GEMMs on CPU; on GPU CTranslate2 picks int8_float16 for them.
        self.translator = ctranslate2.Translator(model_dir, device=device, compute_type="default",
                                                 inter_threads=1, intra_threads=max(0, num_threads))
        self.suppress = [[sp.id_to_piece(cfg.pad_id)], [sp.id_to_piece(cfg.bos_id)]]
        log.info("ctranslate2: %s on %s (%s)", model_dir, device, self.translator.compute_type)

    def translate_ids(self, sources: Sequence[Sequence[int]]) -> list[list[int]]:
        """Model inputs (pieces + eos) -> output ids without eos, in input order."""
        s = self.settings
        groups: dict[int, list[int]] = defaultdict(list)
        for i, src in enumerate(sources):
            groups[output_budget(len(src), s.max_len_a, s.max_len_b, self.max_positions)].append(i)
        out: list[list[int]] = [[] for _ in sources]
        for budget, members in groups.items():
            tokens = [[self.sp.id_to_piece(int(t)) for t in sources[i]] for i in members]
            results = self.translator.translate_batch(
                tokens, beam_size=s.beam_size, length_penalty=s.alpha, max_decoding_length=budget,
                max_input_length=0, suppress_sequences=self.suppress)
            for i, r in zip(members, results):
                out[i] = [self.sp.piece_to_id(p) for p in r.hypotheses[0]]
        return out
