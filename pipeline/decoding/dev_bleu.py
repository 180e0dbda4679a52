"""Dev BLEU of one checkpoint (``score_checkpoint``), and the settings that decide it.

What one validation does: the dev split (newstest2013 for WMT14, the custom dev set otherwise;
``dev_bleu.sentences`` caps it) decoded with CTranslate2 (the checkpoint converted here with
``pipeline.decoding.conversion``, ``dev_bleu.quantization``), greedy or beam
(``dev_bleu.beam_size``, 0 = ``decode.beam_size``; alpha and max length from ``decode``), then
sacreBLEU, chrF and the paper's tokenized BLEU (``scoring.score_split``). A model with an option
after 2017 (pre-norm, RMSNorm, SwiGLU, rotary) is converted from a spec of its weights
(``conversion.export_ct2_spec``); one that neither route holds (``conversion.ct2_unexportable``:
Table 3 rows A, B, E) is decoded with our beam search instead, and says so.

Who calls it: the train stage's Ray Train validation task (``pipeline/train/dev_bleu_task.py``,
each registered checkpoint while training runs) and ``average`` (a kept checkpoint without a
record made with this config's settings). Their records: ``dev_bleu_records.py``.
"""

from __future__ import annotations

import json
import logging
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from pipeline.config import Config, DecodeSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DevBleuSettings:
    """What decides a dev BLEU number (recorded with it; `average` keys on these)."""

    sentences: int  # 0 = all
    engine: str  # "ctranslate2" | "torch"
    quantization: str  # CTranslate2 weights: "int8" | "float32"
    decode: DecodeSettings  # beam_size (dev_bleu.beam_size, 0 = decode.beam_size), alpha, max length

    @classmethod
    def from_config(cls, cfg: Config) -> "DevBleuSettings":
        dev = cfg.dev_bleu
        decode = replace(DecodeSettings.of(cfg.decode), beam_size=dev.beam_size or cfg.decode.beam_size)
        return cls(dev.sentences, dev.engine, dev.quantization, decode)

    def to_dict(self) -> dict[str, Any]:
        """Flat, as the records hold them: sentences, engine, quantization, then the decode fields."""
        return {"sentences": self.sentences, "engine": self.engine, "quantization": self.quantization,
                **asdict(self.decode)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DevBleuSettings":
        """The inverse of ``to_dict``."""
        rest = dict(d)
        return cls(rest.pop("sentences"), rest.pop("engine"), rest.pop("quantization"), DecodeSettings.of(rest))


def record_key(settings: dict[str, Any]) -> dict[str, Any]:
    """The settings a record was made with, less what cannot change its number: alpha, for
    CTranslate2 at beam 1 (greedy: its length_penalty acts in beam search only; checked against
    CTranslate2 itself in tests/integration/test_export.py). So a rerun with another ``decode.alpha``
    reuses the greedy validations training made instead of scoring every checkpoint again.
    Our own search at beam 1 keeps alpha: its exact stopping bound can pick a longer hypothesis."""
    if settings.get("engine") == "ctranslate2" and settings.get("beam_size") == 1:
        return {k: v for k, v in settings.items() if k != "alpha"}
    return settings


def metrics_of(result: dict[str, Any]) -> dict[str, float]:
    key = result["tok_metric"]
    return {"dev/bleu_sacre": result["bleu_sacre"], "dev/chrf": result["chrf"], f"dev/{key}": result[key]}


def score_checkpoint(folder: str, dev_dir: str, spm: str, settings: DevBleuSettings, tgt_lang: str,
                     device: str = "cpu", threads: int = 1, batch_tokens: int = 4000,
                     preprocess: str = "none") -> dict[str, Any]:
    """Decode the dev split with the checkpoint in ``folder`` (model.pt + meta.json) and score it."""
    from pipeline.decoding.batching import read_split
    from pipeline.decoding.bleu import paper_metric
    from pipeline.decoding.scoring import score_split

    model_config = json.loads((Path(folder) / "meta.json").read_text())["model_config"]
    df = read_split(dev_dir, ["idx", "src_ids", "tgt"])
    if settings.sentences:
        df = df.iloc[:settings.sentences]
    with tempfile.TemporaryDirectory(prefix="dev-bleu-") as tmp:
        engine, ct2_model = _engine(folder, model_config, spm, settings, Path(tmp))
        hyps = decode(str(Path(folder) / "model.pt"), model_config, spm, settings, df["src_ids"], engine,
                      ct2_model, device, threads, batch_tokens)
    s = score_split(hyps, [str(t) for t in df["tgt"]], tgt_lang, preprocess)
    key = paper_metric(tgt_lang, preprocess)
    return {"bleu_sacre": s["bleu_sacre"], "chrf": s["chrf"], key: s[key], "tok_metric": key,
            "sacrebleu_signature": s["sacrebleu_signature"], "num_sentences": len(hyps), "engine": engine,
            "threads": threads, "device": device}


def _engine(folder: str, model_config: dict[str, Any], spm: str, settings: DevBleuSettings,
            tmp: Path) -> tuple[str, str]:
    """("ctranslate2-int8", its folder) converted here with the export code, or ("torch", "") when
    asked for or when CTranslate2 is not given the model (logged)."""
    if settings.engine == "torch":
        return "torch", ""
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()  # no "Writing model shards" bars per checkpoint

    from model import ModelConfig
    from pipeline.decoding.conversion import ct2_unexportable, export_ct2, export_ct2_spec, export_hf, unexportable

    mc = ModelConfig.from_dict(model_config)
    why = ct2_unexportable(mc)
    if why:
        log.warning("dev BLEU: CTranslate2 cannot hold this model (%s): decoding with our beam search", why)
        return "torch", ""
    state = torch.load(Path(folder) / "model.pt", weights_only=True, map_location="cpu")
    if unexportable(mc) is None:  # the paper's model: through the Marian folder, as `export` does
        export_hf(state, mc, spm, tmp / "hf")
        export_ct2(tmp / "hf", tmp / "ct2", settings.quantization)
    else:  # an option after 2017
        export_ct2_spec(state, mc, spm, tmp / "ct2", settings.quantization)
    return f"ctranslate2-{settings.quantization}", str(tmp / "ct2")


def decode(model_path: str, model_config: dict[str, Any], spm: str, settings: DevBleuSettings, src_ids: Any,
           engine: str, ct2_model: str, device: str, threads: int, batch_tokens: int) -> list[str]:
    """Hypotheses for ``src_ids`` in order, with translate's batching and bad-input handling."""
    import pandas as pd

    from model import max_source_len
    from pipeline.decoding.batching import plan_split
    from pipeline.decoding.translator import Translator

    dec = settings.decode
    tr = Translator(model_path, model_config, spm, asdict(dec), device, threads,
                    backend="torch" if engine == "torch" else "ctranslate2", ct2_model=ct2_model)
    frame = pd.DataFrame({"idx": range(len(src_ids)), "src_ids": list(src_ids)})
    max_len = max_source_len(tr.cfg.max_positions, dec.max_len_a, dec.max_len_b)
    rows, _ = plan_split("dev", frame, max_len, tr.cfg.eos_id, batch_tokens)
    hyps = [""] * len(frame)
    for _, group in rows.groupby("batch_id", sort=False):
        out, failed = tr.translate_safely([list(s) for s in group["src_ids"]])
        if any(failed):
            raise RuntimeError(f"dev BLEU: {sum(failed)} sentence(s) failed to decode")
        for i, h in zip(group["idx"], out):
            hyps[int(i)] = h
    return hyps
