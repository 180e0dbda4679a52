"""A Ray Serve application: ``POST /translate {"text": [...]}`` -> ``{"translations": [...]}``.

    serve run pipeline.serve.app:build_app work_dir=work/local                         # our beam search
    serve run pipeline.serve.app:build_app work_dir=work/local backend=ctranslate2 num_replicas=2 max_batch_size=32

Arguments (``key=value`` after the import path, or a dict to ``build_app``) are the fields of
``ServeSettings``. Each replica loads the model once (``Translator``: ours, or the exported
CTranslate2 model), and sentences from concurrent requests are decoded together: every
sentence of a request is one call of a ``@serve.batch`` method, which runs up to
``max_batch_size`` sentences in one beam search (waiting at most ``batch_wait_timeout_s``).

Bad input is answered, never dropped, and never takes the replica down: invalid UTF-8 or JSON,
a body that is not ``{"text": [...]}``, a non-string, an empty list, more than
``max_sentences_per_request`` sentences, or a sentence over ``max_sentence_chars`` characters or
the model's source length (pieces) each get a 4xx whose ``detail`` names the problem (and the
sentence's index). An empty string translates to "". ``GET /health`` says what is loaded.
"""

# No `from __future__ import annotations`: FastAPI reads the endpoints' annotations (Request).
import asyncio
import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from ray import serve

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]


@dataclass
class ServeSettings:
    """What ``serve run ... key=value`` may set (strings are converted to these types)."""

    work_dir: str = ""  # the latest average / vocab / export outputs here; or give the three below
    model_dir: str = ""  # an `average` output dir (model.pt + model_config.json)
    spm: str = ""  # the vocab stage's spm.model
    ct2_model: str = ""  # backend=ctranslate2: an exported CTranslate2 folder (default: work_dir's export)
    backend: str = "torch"  # "torch" (our beam search, the reference) | "ctranslate2" (fast path)
    ct2_quantization: str = "int8"  # which of work_dir's exported CTranslate2 models
    beam_size: int = 4  # §6.1
    alpha: float = 0.6  # §6.1 (GNMT length penalty; CTranslate2 applies its own |Y|^alpha)
    max_len_a: float = 1.0  # §6.1: output budget a * source length + b
    max_len_b: int = 50
    num_replicas: int = 1
    num_cpus_per_replica: float = 1.0  # also the torch / CTranslate2 threads of a replica
    max_batch_size: int = 16  # sentences decoded together by one replica
    batch_wait_timeout_s: float = 0.01
    max_sentences_per_request: int = 64
    max_sentence_chars: int = 2000

    @classmethod
    def from_args(cls, args: dict[str, Any]) -> "ServeSettings":
        """Typed settings from ``serve run``'s string arguments; unknown keys are an error naming them."""
        from pipeline.config import typed_fields

        s = cls(**typed_fields(cls, dict(args), "serve run's arguments"))
        if s.backend not in ("torch", "ctranslate2"):
            raise ValueError(f"serve argument backend={s.backend!r}: must be torch or ctranslate2")
        if not s.work_dir and not (s.model_dir and s.spm):
            raise ValueError("serve: give work_dir=..., or model_dir=... and spm=...")
        return s


def resolve_model(s: ServeSettings) -> dict[str, Any]:
    """``Translator`` keyword arguments for these settings (paths from the work dir's latest outputs)."""
    from pipeline.evaluate import translate

    if s.model_dir:
        model_path, model_config = translate._find_model(s.model_dir)
    else:
        avg = translate._latest_outputs(s.work_dir, "average")
        model_path, model_config = avg["model"], avg["model_config"]
    spm_path = s.spm or translate._latest_outputs(s.work_dir, "vocab")["model"]
    ct2_model = s.ct2_model
    if s.backend == "ctranslate2" and not ct2_model:
        ct2_model = translate._latest_outputs(s.work_dir, "export")[f"ct2_{s.ct2_quantization}"]
    settings = translate.DecodeSettings(s.beam_size, s.alpha, s.max_len_a, s.max_len_b)
    return {"model_path": model_path, "model_config": model_config, "spm_path": spm_path,
            "settings": dataclasses.asdict(settings), "device": "cpu",
            "num_threads": max(1, int(s.num_cpus_per_replica)), "backend": s.backend, "ct2_model": ct2_model}


def parse_request(body: bytes, max_sentences: int, max_chars: int) -> list[str]:
    """The sentences of a request body, or an HTTPException naming what is wrong with it."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise HTTPException(400, f"request body is not valid UTF-8 (byte {e.start})") from None
    try:
        payload = json.loads(text)
    except json.JSONDecodeError as e:
        raise HTTPException(400, f"request body is not valid JSON: {e}") from None
    if not isinstance(payload, dict) or "text" not in payload:
        raise HTTPException(422, 'request body must be a JSON object {"text": [sentence, ...]}')
    sentences = payload["text"]
    if not isinstance(sentences, list):
        raise HTTPException(422, f'"text" must be a list of strings, got {type(sentences).__name__}')
    if not sentences:
        raise HTTPException(422, '"text" is an empty list: nothing to translate')
    if len(sentences) > max_sentences:
        raise HTTPException(413, f'"text" has {len(sentences)} sentences; at most {max_sentences} per request')
    for i, s in enumerate(sentences):
        if not isinstance(s, str):
            raise HTTPException(422, f'"text"[{i}] is a {type(s).__name__}, not a string')
        if len(s) > max_chars:
            raise HTTPException(413, f'"text"[{i}] has {len(s)} characters; the limit is {max_chars}')
    return sentences


api = FastAPI(title="transformer-repro translation")


@serve.deployment
@serve.ingress(api)
class Translation:
    """One replica: the model loaded once, sentences of concurrent requests batched together."""

    def __init__(self, settings: dict[str, Any]):
        from pipeline.evaluate import translate

        self.s = ServeSettings(**settings)
        kwargs = resolve_model(self.s)
        self.tr = translate.Translator(**kwargs)
        self.max_source_len = translate.max_source_len(self.tr.cfg.max_positions, self.s.max_len_a, self.s.max_len_b)
        self.info = {"backend": self.s.backend, "model": kwargs["ct2_model"] or kwargs["model_path"],
                     "beam_size": self.s.beam_size, "max_batch_size": self.s.max_batch_size}
        self.translate_one.set_max_batch_size(self.s.max_batch_size)
        self.translate_one.set_batch_wait_timeout_s(self.s.batch_wait_timeout_s)
        log.info("translation replica ready: %s", self.info)

    @serve.batch(max_batch_size=16, batch_wait_timeout_s=0.01)
    async def translate_one(self, sources: list[list[int]]) -> list[str]:
        """Model inputs of up to max_batch_size sentences (any requests) -> their hypotheses.
        Decoding runs in a thread, so the replica keeps answering (health, bad requests) meanwhile."""
        hyps, failed = await asyncio.to_thread(self.tr.translate_safely, sources)
        return [None if f else h for h, f in zip(hyps, failed)]

    @api.post("/translate")
    async def translate(self, request: Request) -> dict[str, list[str]]:
        sentences = parse_request(await request.body(), self.s.max_sentences_per_request, self.s.max_sentence_chars)
        ids = [self.tr.sp.encode(s) for s in sentences]
        for i, p in enumerate(ids):
            if len(p) + 1 > self.max_source_len:
                raise HTTPException(413, f'"text"[{i}] is {len(p) + 1} pieces long (eos included); '
                                         f"the model takes at most {self.max_source_len}")
        real = [i for i, p in enumerate(ids) if p]
        outs = await asyncio.gather(*(self.translate_one(ids[i] + [self.tr.cfg.eos_id]) for i in real))
        if any(o is None for o in outs):
            raise HTTPException(500, "decoding failed for a sentence of this request (see the replica log)")
        translations = [""] * len(sentences)  # an empty sentence translates to ""
        for i, o in zip(real, outs):
            translations[i] = o
        return {"translations": translations}

    @api.get("/health")
    async def health(self) -> dict[str, Any]:
        return {"status": "ok", **self.info}

    def check_health(self) -> None:  # Ray Serve's replica health check
        if self.tr is None:
            raise RuntimeError("model not loaded")


def build_app(args: dict[str, Any]) -> Any:
    """The application for ``serve run pipeline.serve.app:build_app key=value ...``."""
    s = ServeSettings.from_args(dict(args))
    resolve_model(s)  # fail in the driver, with the path named, rather than in every replica
    deployment = Translation.options(
        num_replicas=s.num_replicas, ray_actor_options={
            "num_cpus": s.num_cpus_per_replica,
            # replicas import this project whichever directory `serve run` was started from
            "runtime_env": {"env_vars": {"PYTHONPATH": str(REPO)}}})
    return deployment.bind(dataclasses.asdict(s))
