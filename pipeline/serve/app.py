"""A Ray Serve application: ``POST /translate {"text": [...]}`` -> ``{"translations": [...]}``.

    serve run pipeline.serve.app:build_app run_record=work/last-run.json            # the last run's model (make serve)
    serve run pipeline.serve.app:build_app config=configs/local.toml                 # the config's own model
    serve run pipeline.serve.app:build_app config=configs/base.toml work_dir=s3://bucket/wd backend=ctranslate2
    serve run pipeline.serve.app:build_app model=models:/transformer-base-en-de/1    # a registry version
    serve run pipeline.serve.app:build_app model_dir=work/local/average/<key> spm=<spm.model>

Arguments (``key=value`` after the import path, or a dict to ``build_app``) are the fields of
``ServeSettings``; which model they name is ``pipeline.models.find_model``'s answer (the one
lookup of the project). Each replica loads the model once (``Translator``: ours, or the
exported CTranslate2 model), and sentences from concurrent requests are decoded together:
every sentence of a request is one call of a ``@serve.batch`` method, which runs up to
``max_batch_size`` sentences in one beam search (waiting at most ``batch_wait_timeout_s``).
A model trained on preprocessed text (``data.preprocess``, e.g. Multi30k's lowercased Moses tokens)
gets each sentence preprocessed the same way, and its output back Moses-detokenized
(``pipeline/decoding/text.py``; ``GET /health`` shows the format).

Client mistakes get a 4xx whose ``detail`` names the problem (``pipeline/serve/request.py``:
body size, UTF-8, JSON, the body's shape; here: a sentence over the model's source length in
pieces) and never take the replica down; a 500 means a server fault (a sentence failed to
decode). Overload: a replica takes ``max_ongoing_requests`` at once and the proxy queues
``max_queued_requests`` more; beyond that Ray Serve answers 503 with ``Retry-After:
retry_after_s`` at once, so latency stays bounded instead of growing with the queue.
``max_replicas`` > 0 turns on Ray Serve autoscaling between ``min_replicas`` and ``max_replicas``.
``GET /health`` says what is loaded.
"""

# No `from __future__ import annotations`: FastAPI reads the endpoints' annotations (Request).
import asyncio
import dataclasses
import logging
import os
import tempfile
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import HTMLResponse
from ray import serve

from pipeline.config import DecodeSettings
from pipeline.serve.request import MAX_ALPHA, parse_translate, read_body

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
PAGE = (Path(__file__).with_name("page.html")).read_text(encoding="utf-8")  # self-contained: no CDN, no build
# Where the object store is (not who may read it): replicas read the model where the driver found
# it; credentials come from each node's own environment or instance role, as for every Ray worker.
STORE_LOCATION_ENV = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_DEFAULT_REGION",
                      "STORAGE_EMULATOR_HOST", "MLFLOW_TRACKING_URI")


@dataclass(kw_only=True)
class ServeSettings(DecodeSettings):
    """What ``serve run ... key=value`` may set (strings are converted to these types); the decode
    settings (beam_size, alpha, max_len_a, max_len_b) are ``DecodeSettings``'s fields."""

    config: str = ""  # pipeline config file(s), comma-separated: serve the model of their DAG plan
    overrides: str = ""  # with config: the run's --section.key=value overrides, space-separated
    work_dir: str = ""  # with config or run_record: instead of its run.work_dir (a local path or s3://...)
    run_record: str = ""  # a run's record (reproduce_base.py --record; make serve: work/last-run.json): its model
    model: str = ""  # models:/<name>/<version> or models:/<name>@<alias> (the MLflow Model Registry)
    tracking_uri: str = ""  # with model: the registry's MLflow (default: MLFLOW_TRACKING_URI)
    model_dir: str = ""  # explicit paths: an `average` output dir (model.pt + model_config.json) ...
    spm: str = ""  # ... and the vocab stage's spm.model
    ct2_model: str = ""  # explicit paths, backend=ctranslate2: an exported CTranslate2 folder
    backend: str = "torch"  # "torch" (our beam search, the reference) | "ctranslate2" (fast path)
    ct2_quantization: str = "int8"  # which exported CTranslate2 model (config / registry)
    num_replicas: int = 1
    min_replicas: int = 1  # with max_replicas > 0: Ray Serve autoscaling between the two
    max_replicas: int = 0  # 0 = a fixed num_replicas
    num_cpus_per_replica: float = 1.0  # also the torch / CTranslate2 threads of a replica
    max_batch_size: int = 16  # sentences decoded together by one replica
    batch_wait_timeout_s: float = 0.01
    max_ongoing_requests: int = 16  # requests a replica works on at once (enough to fill a batch)
    max_queued_requests: int = 8  # requests the proxy holds for busy replicas; beyond: 503
    retry_after_s: float = 1.0  # the 503's Retry-After
    max_sentences_per_request: int = 64
    max_sentence_chars: int = 2000
    max_request_bytes: int = 1 << 20  # 64 sentences * 2000 characters fit even as \uXXXX escapes
    max_beam_size: int = 8  # a request's "beam_size" (our beam search) may go up to this
    max_attention_pieces: int = 128  # "attention": true for a sentence of at most this many source pieces

    @classmethod
    def from_args(cls, args: dict[str, Any]) -> "ServeSettings":
        """Typed settings from ``serve run``'s string arguments; unknown keys are an error naming them."""
        from pipeline.config import Backend, ConfigError, typed_fields

        s = cls(**typed_fields(cls, dict(args), "serve run's arguments"))
        s.check("serve argument ")
        if s.backend not in typing.get_args(Backend):
            raise ConfigError(f"serve argument backend={s.backend!r}: must be torch or ctranslate2")
        if s.max_replicas and "num_replicas" in args:
            raise ConfigError("serve arguments: num_replicas (fixed) and max_replicas (autoscaling) exclude each other")
        if s.max_replicas and not 0 <= s.min_replicas <= s.max_replicas:
            raise ConfigError(f"serve arguments: need 0 <= min_replicas ({s.min_replicas}) <= max_replicas "
                              f"({s.max_replicas})")
        for key in ("max_ongoing_requests", "max_request_bytes", "max_batch_size", "num_replicas", "max_beam_size",
                    "max_attention_pieces"):
            if getattr(s, key) < 1:
                raise ConfigError(f"serve argument {key}={getattr(s, key)}: must be >= 1")
        return s


def find_files(s: ServeSettings, download_dir: str | None = None) -> Any:
    """The model these settings name (``pipeline.models.find_model``)."""
    from pipeline.models import find_model

    return find_model(config=[c for c in s.config.split(",") if c], overrides=s.overrides.split(),
                      work_dir=s.work_dir, run_record=s.run_record, model_uri=s.model, tracking_uri=s.tracking_uri,
                      model_dir=s.model_dir, spm=s.spm, ct2_model=s.ct2_model, download_dir=download_dir)


def translator_kwargs(s: ServeSettings, files: Any) -> dict[str, Any]:
    """``Translator`` keyword arguments for these settings and model files."""
    return {"model_path": files.model, "model_config": files.model_config, "spm_path": files.spm,
            "settings": dataclasses.asdict(DecodeSettings.of(s)), "device": "cpu",
            "num_threads": max(1, int(s.num_cpus_per_replica)), "backend": s.backend,
            "ct2_model": files.ct2_model(s.ct2_quantization) if s.backend == "ctranslate2" else "",
            "text": files.text}


api = FastAPI(title="transformer-repro translation")


@serve.deployment
@serve.ingress(api)
class Translation:
    """One replica: the model loaded once, sentences of concurrent requests batched together."""

    def __init__(self, settings: dict[str, Any]):
        from model import max_source_len
        from pipeline.decoding import translator

        self.s = ServeSettings(**settings)
        self.files = files = find_files(self.s)
        kwargs = translator_kwargs(self.s, files)
        self.tr = translator.Translator(**kwargs)
        self.attention_model = None  # our model for "attention": true (the CTranslate2 backend loads it then)
        self.max_source_len = max_source_len(self.tr.cfg.max_positions, self.s.max_len_a, self.s.max_len_b)
        self.info = {"backend": self.s.backend, "model": kwargs["ct2_model"] or kwargs["model_path"],
                     "origin": files.origin, "text": self.tr.text.to_dict(),
                     **dataclasses.asdict(DecodeSettings.of(self.s)),
                     "max_batch_size": self.s.max_batch_size, "max_beam_size": self.s.max_beam_size,
                     "max_alpha": MAX_ALPHA, "max_attention_pieces": self.s.max_attention_pieces,
                     "max_sentence_chars": self.s.max_sentence_chars, "scores": files.scores,
                     "model_config": {k: self.tr.cfg.to_dict()[k] for k in ("d_model", "n_heads", "n_encoder_layers",
                                                                             "n_decoder_layers", "vocab_size")}}
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
    async def translate(self, request: Request) -> dict[str, Any]:
        body = await read_body(request.headers, request.stream(), self.s.max_request_bytes)
        req = parse_translate(body, self.s.max_sentences_per_request, self.s.max_sentence_chars, self.s.max_beam_size)
        ids = [self.tr.sp.encode(s) for s in self.tr.text.sources(req.sentences)]  # as the training text was
        for i, p in enumerate(ids):
            if len(p) + 1 > self.max_source_len:
                raise HTTPException(413, f'"text"[{i}] is {len(p) + 1} pieces long (eos included); '
                                         f"the model takes at most {self.max_source_len}")
        if req.attention or req.explain:
            self._check_attention(ids[0], "explain" if req.explain and not req.attention else "attention")
        if req.explain:
            # the decoder's query range once the translation is known (`_explain`)
            self._check_explain(req.explain, len(ids[0]) + 1 if req.explain.kind == "encoder_self" else None)
        settings = self._settings(req)
        real = [i for i, p in enumerate(ids) if p]
        if settings is None:  # the server's settings: batched with other requests' sentences
            outs = await asyncio.gather(*(self.translate_one(ids[i] + [self.tr.cfg.eos_id]) for i in real))
        else:  # its own beam size or alpha: decoded on its own, in a thread
            hyps, failed = await asyncio.to_thread(self.tr.translate_safely,
                                                   [ids[i] + [self.tr.cfg.eos_id] for i in real], settings)
            outs = [None if f else h for h, f in zip(hyps, failed)]
        if any(o is None for o in outs):
            raise HTTPException(500, "decoding failed for a sentence of this request (see the replica log)")
        translations = [""] * len(req.sentences)  # an empty sentence translates to ""
        for i, o in zip(real, outs):
            translations[i] = self.tr.text.output(o)
        answer: dict[str, Any] = {"translations": translations}
        if req.attention:
            att = await asyncio.to_thread(self._attention, ids[0], outs[0])
            answer["attention"] = att.to_json()
        if req.explain:
            answer["explanation"] = await asyncio.to_thread(self._explain, ids[0], outs[0], req.explain)
        return answer

    def _settings(self, req: Any) -> DecodeSettings | None:
        """The request's decode settings when they differ from the server's (None: the server's)."""
        server = DecodeSettings.of(self.s)
        asked = dataclasses.replace(server, **{k: v for k, v in (("beam_size", req.beam_size), ("alpha", req.alpha))
                                               if v is not None})
        if asked == server:
            return None
        if self.s.backend != "torch":
            raise HTTPException(422, f'"beam_size" and "alpha" per request need backend=torch; this server runs '
                                     f"{self.s.backend} with beam_size {server.beam_size}, alpha {server.alpha}")
        return asked

    def _check_attention(self, pieces: list[int], key: str) -> None:
        asked = '"attention": true' if key == "attention" else '"explain"'
        if not pieces:
            raise HTTPException(422, f'{asked} needs a sentence with some text: "text"[0] has none')
        if len(pieces) + 1 > self.s.max_attention_pieces:
            raise HTTPException(413, f'{asked} is given for sentences of at most {self.s.max_attention_pieces} '
                                     f'pieces (eos included; max_attention_pieces); "text"[0] has {len(pieces) + 1}')

    def _check_explain(self, ask: Any, n_queries: int | None) -> None:
        """A 422 naming the index of "explain" out of range for this model (and this sentence's map)."""
        from pipeline.decoding.attention_explain import explain_problem

        problem = explain_problem(self.tr.cfg, ask.kind, ask.layer, ask.head, ask.query, n_queries)
        if problem:
            raise HTTPException(422, f'"explain": {problem}')

    def _our_model(self) -> Any:
        """The torch backend's own model; CTranslate2's server loads ours once, on the first request that needs it."""
        from pipeline.decoding.translator import load_model

        if self.attention_model is None:
            self.attention_model = (self.tr.model if self.s.backend == "torch"
                                    else load_model(self.files.model, self.files.model_config))
        return self.attention_model

    def _attention(self, pieces: list[int], hypothesis: str) -> Any:
        """`pipeline.decoding.attention_maps.translation_attention`: the function the score report draws with."""
        from pipeline.decoding.attention_maps import translation_attention

        return translation_attention(self._our_model(), self.tr.sp, pieces, hypothesis)

    def _explain(self, pieces: list[int], hypothesis: str, ask: Any) -> dict[str, Any]:
        """`pipeline.decoding.attention_explain.explain_attention` on the pass `_attention` maps."""
        from pipeline.decoding.attention_explain import explain_attention

        if ask.kind != "encoder_self":  # the decoder's positions: the hypothesis's pieces, then eos
            self._check_explain(ask, len(self.tr.sp.encode(hypothesis, out_type=int)) + 1)
        return explain_attention(self._our_model(), self.tr.sp, pieces, hypothesis, ask.kind, ask.layer, ask.head,
                                 ask.query)

    @api.get("/", response_class=HTMLResponse)
    async def page(self) -> HTMLResponse:
        """The page: a sentence in, its translation and attention out (pipeline/serve/page.html)."""
        return HTMLResponse(PAGE)

    @api.get("/health")
    async def health(self) -> dict[str, Any]:
        return {"status": "ok", **self.info}

    def check_health(self) -> None:  # Ray Serve's replica health check
        if self.tr is None:
            raise RuntimeError("model not loaded")


def deployment_options(s: ServeSettings) -> dict[str, Any]:
    """Replicas, resources and backpressure for ``Translation.options``."""
    env = {"PYTHONPATH": str(REPO),  # replicas import this project wherever `serve run` was started
           **{k: os.environ[k] for k in STORE_LOCATION_ENV if os.environ.get(k)}}
    scaling: dict[str, Any] = ({"autoscaling_config": {"min_replicas": s.min_replicas, "max_replicas": s.max_replicas,
                                                        "target_ongoing_requests": s.max_ongoing_requests / 2}}
                               if s.max_replicas else {"num_replicas": s.num_replicas})
    return {**scaling, "max_ongoing_requests": s.max_ongoing_requests, "max_queued_requests": s.max_queued_requests,
            "backpressure_config": {"status_code": 503, "retry_after_s": s.retry_after_s},
            "ray_actor_options": {"num_cpus": s.num_cpus_per_replica, "runtime_env": {"env_vars": env}}}


def build_app(args: dict[str, Any]) -> Any:
    """The application for ``serve run pipeline.serve.app:build_app key=value ...``."""
    s = ServeSettings.from_args(dict(args))
    with tempfile.TemporaryDirectory() as tmp:  # a registry version's copy: each replica downloads its own
        translator_kwargs(s, find_files(s, tmp))  # fail in the driver, naming the stage or file, not in every replica
    return Translation.options(**deployment_options(s)).bind(dataclasses.asdict(s))
