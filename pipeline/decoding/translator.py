"""``Translator``: a model (our beam search or CTranslate2) loaded once, translating batches of ids.

A Ray Data actor class (``map_batches(Translator, ...)``, the translate stage), the CLI's engine
(``python -m pipeline.decoding.translate_cli``), dev BLEU's and the Ray Serve replicas' alike.
``backend = "ctranslate2"`` runs the ``export`` stage's CTranslate2 model instead of our beam
search (``ct2_backend.py``; the same batches, order and bad-input handling).
``translate_lines``: plain-text lines -> hypotheses in the same order (the CLI's loop).
"""

from __future__ import annotations

import logging
import typing
from typing import Any, Sequence

import pandas as pd
import torch

from model import ModelConfig, Transformer, beam_search, max_source_len
from pipeline import storage
from pipeline.config import Backend, DecodeSettings
from pipeline.cpu_threads import use_threads
from pipeline.decoding.batching import pad_batch, plan_batches, prepare_sources
from pipeline.decoding.text import TextFormat

log = logging.getLogger(__name__)


def model_config_of(model_config: ModelConfig | dict[str, Any]) -> ModelConfig:
    """A ``ModelConfig`` from a manifest's ``model_config`` dict (or the object itself)."""
    return model_config if isinstance(model_config, ModelConfig) else ModelConfig.from_dict(model_config)


def load_model(model_path: str, model_config: ModelConfig | dict[str, Any], device: str = "cpu") -> Transformer:
    """The Transformer with a ``model.pt`` state dict, in eval mode on ``device``."""
    model = Transformer(model_config_of(model_config))
    state = torch.load(storage.local_copy(model_path), weights_only=True, map_location="cpu")
    model.load_state_dict(state)
    return model.to(device).eval()


class Translator:
    """Loads the model and the SentencePiece model once; translates batches of token ids.

    A Ray Data actor class (``map_batches(Translator, ...)``) and the CLI's engine alike.
    ``__call__`` takes a pandas batch with ``batch_id`` and ``src_ids`` (plus any key columns,
    passed through) and returns it with ``hyp`` (detokenized text) and ``failed`` instead of
    ``src_ids``; each ``batch_id`` group is one beam-search call.
    """

    def __init__(self, model_path: str, model_config: ModelConfig | dict[str, Any], spm_path: str,
                 settings: dict[str, Any], device: str = "cpu", num_threads: int = 0,
                 backend: str = "torch", ct2_model: str = "", text: dict[str, str] | None = None):
        import sentencepiece as spm

        if device == "cpu":
            use_threads(num_threads)
        if device == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("translate: a GPU was asked for but torch sees none")
        self.device = device
        self.settings = DecodeSettings.of(settings)
        self.cfg = model_config_of(model_config)
        # the model's text (data.preprocess): translate_lines and the server apply it to user text
        self.text = TextFormat.of(text)
        self.sp = spm.SentencePieceProcessor(model_file=str(storage.local_copy(spm_path)))
        self._specials = {self.cfg.pad_id, self.cfg.bos_id, self.cfg.eos_id}
        self.ct2 = None  # decode.backend = "ctranslate2": the export stage's model (ct2_backend.py)
        if backend == "ctranslate2":
            from pipeline.decoding.ct2_backend import CT2Engine

            self.ct2 = CT2Engine(str(storage.local_copy(ct2_model)), self.sp, self.cfg, self.settings,
                                 device, num_threads)
        elif backend == "torch":
            self.model = load_model(model_path, self.cfg, device)
        else:
            raise ValueError(f"translate: unknown backend {backend!r} ({' | '.join(typing.get_args(Backend))})")

    def translate_ids(self, sources: Sequence[Sequence[int]], settings: DecodeSettings | None = None) -> list[str]:
        """Model inputs (pieces + eos, no padding) -> detokenized hypotheses; `settings` (our beam
        search only): instead of the translator's own (a Serve request's beam_size or alpha)."""
        s = settings or self.settings
        if self.ct2 is not None:
            if settings is not None and settings != self.settings:
                raise ValueError("the CTranslate2 engine decodes with the settings it was built with")
            return [self.detokenize(ids) for ids in self.ct2.translate_ids(sources)]
        src = pad_batch(sources, self.cfg.pad_id).to(self.device)
        out = beam_search(self.model, src, beam_size=s.beam_size, alpha=s.alpha,
                          max_len_a=s.max_len_a, max_len_b=s.max_len_b)
        return [self.detokenize(ids) for ids in out]

    def detokenize(self, ids: Sequence[int]) -> str:
        text = self.sp.decode([int(t) for t in ids if t not in self._specials])
        return " ".join(text.split())  # one line per sentence, whatever the pieces held

    def translate_safely(self, sources: list[list[int]], settings: DecodeSettings | None = None
                         ) -> tuple[list[str], list[bool]]:
        """A failing batch (e.g. out of memory) is retried one sentence at a time; a sentence
        that still fails gets an empty line and ``failed=True`` (the stage reports them)."""
        try:
            return self.translate_ids(sources, settings), [False] * len(sources)
        except Exception:  # noqa: BLE001 - every failure is logged and counted, never hidden
            log.exception("translate: a batch of %d sentences failed; retrying one by one", len(sources))
        hyps, failed = [], []
        for s in sources:
            try:
                hyps.append(self.translate_ids([s], settings)[0])
                failed.append(False)
            except Exception:  # noqa: BLE001
                log.exception("translate: a sentence of %d tokens failed", len(s))
                hyps.append("")
                failed.append(True)
        return hyps, failed

    def __call__(self, batch: pd.DataFrame) -> pd.DataFrame:
        parts = []
        for _, group in batch.groupby("batch_id", sort=False):
            sources = [[int(t) for t in ids] for ids in group["src_ids"]]
            hyps, failed = self.translate_safely(sources)
            parts.append(group.drop(columns=["src_ids"]).assign(hyp=hyps, failed=failed))
        return pd.concat(parts, ignore_index=True)


def translate_lines(tr: Translator, lines: Sequence[str], batch_tokens: int) -> tuple[list[str], dict[str, int]]:
    """Plain-text lines -> hypotheses in the same order (the CLI's and the engine benchmark's
    loop): a user's text, so the model's preprocessing (``tr.text``) is applied to the lines and
    its output is given back detokenized."""
    s = tr.settings
    sources, truncated = prepare_sources([tr.sp.encode(line) for line in tr.text.sources(list(lines))],
                                         max_source_len(tr.cfg.max_positions, s.max_len_a, s.max_len_b), tr.cfg.eos_id)
    hyps = [""] * len(lines)
    keep = [i for i, src in enumerate(sources) if src is not None]
    for batch in plan_batches([len(sources[i]) for i in keep], batch_tokens):
        members = [keep[m] for m in batch]
        out, _ = tr.translate_safely([sources[i] for i in members])
        for i, h in zip(members, out):
            hyps[i] = tr.text.output(h)
    return hyps, {"num_empty": len(lines) - len(keep), "num_truncated": int(sum(truncated))}
