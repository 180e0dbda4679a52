"""The config's schema: one typed dataclass per section and `Config`, the tree of them.

Precedence: command line > config file > the defaults below (`pipeline.config.loader` reads
them). Unknown keys, wrong types and impossible values are errors that name the key
(``ConfigError``). A field whose valid values are a fixed set is typed with a ``Literal`` (the
aliases below, the one spelling of each set); `Config.validate` and the loader check them from
the annotations, so a section's `validate` checks only the rest.

A field whose metadata says ``cache=False`` is operational (how many workers, how often to log):
changing it never invalidates a cached stage. Everything else is part of a stage's cache key.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from model.config import ModelSizes

from .checks import ConfigError, check as _check, check_allowed, parse_resources
from .migrations import cache_value, keyed_if_set
from .operations import Auto, CheckpointSection, MetricsSection, PlanSection, SpeedSection, WorkersSection, op

# The allowed values of the config's fixed-set fields (`typing.get_args(Backend)` spells a set elsewhere);
# those of the operational sections are in `operations`.
Source = Literal["wmt14", "multi30k", "custom"]  # data.source
Preprocess = Literal["none", "lowercase_moses"]  # data.preprocess
VocabModel = Literal["bpe", "unigram"]  # vocab.model_type
EarlyStopMetric = Literal["dev_bleu", "val_loss"]  # train.early_stop_metric
Backend = Literal["torch", "ctranslate2"]  # decode.backend, dev_bleu.engine (serve's backend)
Quantization = Literal["float32", "int8"]  # decode.ct2_quantization, dev_bleu.quantization (export)
AverageSelect = Literal["last", "best_dev_bleu"]  # average.select
Split = Literal["test", "dev"]  # score.splits


@dataclass(kw_only=True)
class DataSection:
    """Where the parallel text comes from and how it is cleaned (``download``, ``prepare``)."""

    # "wmt14" (the paper's data, §5.1), "multi30k" (Multi30k task 1, the small published benchmark a
    # CPU reproduces: pipeline/data/sources.py) or "custom" (your own files below)
    source: Source = "wmt14"
    src_lang: str = "en"  # source language code
    tgt_lang: str = "de"  # target language code ("fr": the EN-FR data, §5.1)
    # Replaces http://statmt.org/ for every WMT14 file: a URL or a local folder with the same
    # relative paths (wmt13/..., wmt14/...). Empty = the real statmt.org URLs. Multi30k: replaces
    # https://github.com/multi30k/dataset/raw/<commit>/ (a folder holding data/task1/raw/...).
    # In download's cache key for WMT14 only, whose archives are checked against the mirror's own
    # SHA256SUMS (the offline stand-in holds samples); Multi30k's files are checked against pinned
    # sha256s, so there it is operational (pipeline/dag.py).
    mirror: str = ""
    # Text preprocessing applied by prepare to every split before cleaning, as a benchmark defines
    # it. "lowercase_moses": Multi30k's scripts/task1-tokenize.sh (lowercase, Moses punctuation
    # normalization and tokenizer per language, via sacremoses); score then reports the benchmark's
    # BLEU on that text beside sacreBLEU on the raw reference. "none": the text as it is (§5.1).
    preprocess: Preprocess = "none"
    # source = "custom": plain-text files, one sentence per line (local paths or URLs, .gz ok).
    train_src: list[str] = field(default_factory=list)
    train_tgt: list[str] = field(default_factory=list)  # as train_src: the target side
    dev_src: str = ""  # source = "custom": the dev split, source side (one file)
    dev_tgt: str = ""  # source = "custom": the dev split, target side
    test_src: str = ""  # source = "custom": the test split, source side
    test_tgt: str = ""  # source = "custom": the test split, target side
    # Cleaning (counted per rule, never silent; lengths are whitespace words):
    max_words: int = 250  # pairs with a longer side are dropped ("too_long")
    max_length_ratio: float = 3.0  # drop if max(len)/min(len) exceeds this ("length_ratio"); §5.1 is silent
    dedup: bool = False  # drop exact duplicate pairs ("duplicate")
    # source = "wmt14": the training corpora to read, by name (pipeline/data/sources.py: europarl_v7,
    # commoncrawl, news_commentary_v9; EN-FR adds un and giga_fren). Empty = all of them, the paper's
    # data (§5.1). Only the archives of the named corpora are downloaded: local mode reads
    # News Commentary alone, an 80 MB archive instead of ~1.6 GB.
    corpora: list[str] = keyed_if_set([])
    # 0 = all. Keep only the first N training pairs of each corpus (local test mode).
    max_pairs_per_corpus: int = 0
    num_shards: int = 8  # Parquet shards per split written by prepare/encode
    download_timeout_s: float = op(60.0)  # seconds an HTTP request of download may wait (urllib's timeout)

    @property
    def pair(self) -> str:
        """``EN-DE``: how reports name the language pair."""
        return f"{self.src_lang.upper()}-{self.tgt_lang.upper()}"

    def validate(self) -> None:
        if self.source == "custom":
            _check(bool(self.train_src) and len(self.train_src) == len(self.train_tgt),
                   "data.train_src", "custom data needs train_src and train_tgt lists of equal length")
            for k in ("dev_src", "dev_tgt", "test_src", "test_tgt"):
                _check(bool(getattr(self, k)), f"data.{k}", "is required when data.source = 'custom'")
        _check(self.max_words > 0, "data.max_words", "must be > 0")
        _check(self.max_length_ratio >= 1.0, "data.max_length_ratio", "must be >= 1")
        _check(not self.corpora or self.source == "wmt14", "data.corpora",
               f"chooses among WMT14's training corpora; data.source = {self.source!r} has its own files")
        _check(len(set(self.corpora)) == len(self.corpora), "data.corpora", f"names a corpus twice: {self.corpora}")
        _check(self.max_pairs_per_corpus >= 0, "data.max_pairs_per_corpus", "must be >= 0")
        _check(self.num_shards >= 1, "data.num_shards", "must be >= 1")


@dataclass(kw_only=True)
class VocabSection:
    """The shared SentencePiece model (``vocab``)."""

    size: int = 37000  # §5.1: "a shared source-target vocabulary of about 37000 tokens"
    model_type: VocabModel = "bpe"  # §5.1: byte-pair encoding
    sample_sentences: int = 2_000_000  # deterministic sample of both sides used for training SPM
    character_coverage: float = 1.0  # SentencePiece's character_coverage (1.0: every character)
    seed: int = 1234  # seed of the sentence sample SentencePiece trains on
    num_threads: int = op(2)  # SentencePiece trainer threads

    def validate(self) -> None:
        _check(self.size >= 8, "vocab.size", "must be >= 8")
        _check(self.sample_sentences > 0, "vocab.sample_sentences", "must be > 0")
        _check(0.0 < self.character_coverage <= 1.0, "vocab.character_coverage", "must be in (0, 1]")


@dataclass
class ModelSection(ModelSizes):
    """The Transformer's sizes: `model.config.ModelSizes`' fields, defaults (Table 3, base) and
    checks; vocab_size and special ids come from ``vocab`` (`pipeline.models.model_config_for`)."""

    def validate(self) -> None:
        try:
            self.check_sizes("model.")
        except (TypeError, ValueError) as e:
            raise ConfigError(str(e)) from e


@dataclass(kw_only=True)
class TrainSection:
    """The paper's training recipe (§5): what the train stage's cache key holds (``train``).

    How it runs lives beside it: ``speed`` (kernels, precision, micro-batches), ``workers`` (the
    Ray Train group), ``checkpoint``, ``metrics`` (log and dev-loss cadence) and ``plan`` (--plan's bill)."""

    tokens_per_step: int = 25000  # §5.1: ~25000 target tokens per optimizer step
    max_steps: int = 100_000  # §5.2: base model trained 100k steps
    warmup_steps: int = 4000  # §5.3
    lr_scale: float = 1.0  # multiplies the §5.3 formula
    label_smoothing: float = 0.1  # §5.4, eps_ls
    adam_beta1: float = 0.9  # §5.3
    adam_beta2: float = 0.98  # §5.3
    adam_eps: float = 1e-9  # §5.3
    clip_norm: float = 0.0  # 0 = off (the paper does not clip)
    max_len: int = 256  # drop training pairs with more pieces than this on either side (counted)
    seed: int = 1  # seed of the batch plan, the initial weights and each step's dropout (per rank)
    # Early stopping, off by default (the paper trains a fixed train.max_steps, §5.2): stop when
    # early_stop_metric has not improved for this many validations in a row (fairseq --patience,
    # Marian --early-stopping). "dev_bleu": each checkpoint's dev sacreBLEU (dev_bleu.enabled, seen
    # when its validation task ends); "val_loss": the dev loss every metrics.val_loss_interval_steps.
    early_stop_patience: int = keyed_if_set(0)
    early_stop_metric: EarlyStopMetric = keyed_if_set("dev_bleu")  # see early_stop_patience

    def validate(self) -> None:
        _check(self.tokens_per_step > 0, "train.tokens_per_step", "must be > 0")
        _check(self.max_steps > 0, "train.max_steps", "must be > 0")
        _check(self.warmup_steps > 0, "train.warmup_steps", "must be > 0")
        _check(0.0 <= self.label_smoothing < 1.0, "train.label_smoothing", "must be in [0, 1)")
        _check(self.clip_norm >= 0.0, "train.clip_norm", "must be >= 0")
        _check(self.max_len > 0, "train.max_len", "must be > 0")
        _check(self.early_stop_patience >= 0, "train.early_stop_patience", "must be >= 0 (0 = off)")


@dataclass
class DecodeSettings:
    """Beam search settings (§6.1), the one definition: ``decode.*`` (DecodeSection), the translate CLI
    and ``serve run``'s arguments (ServeSettings) all take these fields and defaults."""

    beam_size: int = 4  # §6.1
    alpha: float = 0.6  # §6.1, length penalty (GNMT's; CTranslate2 and HF apply |Y|^alpha)
    max_len_a: float = 1.0  # §6.1: max output length = a * input length + b = input length + 50
    max_len_b: int = 50  # see max_len_a

    @classmethod
    def of(cls, obj: Any) -> "DecodeSettings":
        """The decode fields of an object that has them (a DecodeSection, ServeSettings), or of a
        dict of some of them (the rest default; an unknown key is a TypeError)."""
        if isinstance(obj, dict):
            return cls(**obj)
        return cls(**{f.name: getattr(obj, f.name) for f in dataclasses.fields(cls)})

    def check(self, prefix: str) -> None:
        _check(self.beam_size >= 1, f"{prefix}beam_size", "must be >= 1")
        _check(self.alpha >= 0.0, f"{prefix}alpha", "must be >= 0")
        _check(self.max_len_a >= 0 and self.max_len_b >= 1, f"{prefix}max_len_b", "max length must be >= 1")


@dataclass(kw_only=True)
class AverageSection:
    """Which checkpoints ``average`` averages into the model ``translate`` decodes (§6.1)."""

    checkpoints: int = 5  # §6.1: "averaging the last 5 checkpoints"
    # "last" (§6.1: the last `average.checkpoints`) or "best_dev_bleu" (the `average.checkpoints`
    # kept checkpoints with the highest dev sacreBLEU, from dev BLEU while training).
    select: AverageSelect = "last"

    def validate(self) -> None:
        _check(self.checkpoints >= 1, "average.checkpoints", "must be >= 1")


@dataclass(kw_only=True)
class DecodeSection(DecodeSettings):
    """The ``translate`` stage: beam search (``DecodeSettings``'s fields, §6.1), its engine and its
    Ray Data actors."""

    batch_tokens: int = op(4000)  # source tokens per decoding batch
    num_workers: int = op(1)  # Ray Data actors for translate (one per GPU)
    use_gpu: bool | Auto = op("auto")  # as workers.use_gpu: "auto" = a GPU per actor when the cluster has one
    # torch threads per CPU actor; 0 = auto: the node's CPUs shared out over decode.num_workers
    # (Ray still reserves run.data_num_cpus per actor, so the read tasks keep a CPU).
    threads_per_worker: int = op(0)
    # The decoding engine: "torch" = our beam search (the reference semantics, GNMT length
    # penalty); "ctranslate2" = the `export` stage's CTranslate2 model (the fast path).
    backend: Backend = "torch"
    ct2_quantization: Quantization = "int8"  # the exported CTranslate2 model the backend runs

    def validate(self) -> None:
        self.check("decode.")
        _check(self.batch_tokens > 0, "decode.batch_tokens", "must be > 0")
        _check(self.num_workers >= 1, "decode.num_workers", "must be >= 1")


@dataclass(kw_only=True)
class ScoreSection:
    """What ``translate`` decodes and ``score`` scores and draws."""

    splits: list[Split] = field(default_factory=lambda: ["test"])  # "test" and/or "dev"
    # 0 = every sentence. Otherwise decode and score only the first N sentences of each split:
    # for smoke tests; the report says so, and such a score is not comparable with the paper's.
    max_sentences: int = 0
    # Heatmaps of the averaged model's attention (encoder self, decoder cross; every layer and head)
    # for the first N short test sentences, drawn by `score` beside its report and logged to MLflow.
    attention_sentences: int = 3

    def validate(self) -> None:
        _check(bool(self.splits), "score.splits", "must be a non-empty subset of ['test', 'dev']")
        _check(self.max_sentences >= 0, "score.max_sentences", "must be >= 0 (0 = all)")
        _check(self.attention_sentences >= 0, "score.attention_sentences", "must be >= 0 (0 = none)")


@dataclass(kw_only=True)
class DevBleuSection:
    """Dev BLEU per registered checkpoint while training runs (Ray Train's asynchronous validation,
    pipeline/train/dev_bleu_validation.py). Operational for `train` (no key of train reads this
    section); the settings below decide the numbers, so `average` keys on them when it selects
    by them (``average.select = "best_dev_bleu"``)."""

    enabled: bool = op(True)  # false: no dev BLEU while training (train.early_stop_metric "dev_bleu" needs it)
    sentences: int = 0  # 0 = the whole dev split; else its first N sentences
    engine: Backend = "ctranslate2"  # "ctranslate2" (converted in the task) | "torch" (our beam search)
    quantization: Quantization = "int8"  # the CTranslate2 model the task converts
    beam_size: int = 0  # 0 = decode.beam_size (with decode.alpha, max_len_a/b); 1 = greedy
    # Ray resources of the validation task, "CPU=4" or "GPU=1,CPU=2": its CPUs are its decoding
    # threads; CPU=0 reserves none (it time-shares the training's cores, one thread).
    resources: str = op("CPU=1")

    def validate(self) -> None:
        _check(self.sentences >= 0, "dev_bleu.sentences", "must be >= 0 (0 = all)")
        _check(self.beam_size >= 0, "dev_bleu.beam_size", "must be >= 0 (0 = decode.beam_size)")
        parse_resources(self.resources, "dev_bleu.resources")


@dataclass(kw_only=True)
class RunSection:
    """Where outputs go and how Ray is reached (never part of a cache key)."""

    work_dir: str = op("work")  # local path, s3://..., gs://... or an NFS path; stages write under it
    storage_path: str = op("")  # Ray Train checkpoints; "" = <work_dir>/ray_train
    ray_address: str = op("")  # "" = RAY_ADDRESS if set, else a new local Ray (pipeline.ray_env.ray_address)
    name: str = op("transformer-base")  # the name of the workflow's MLflow parent run
    data_num_cpus: float = op(1.0)  # CPUs per Ray Data task/actor (keep < all CPUs: ray#44687)
    data_concurrency: int = op(1)  # Ray Data actors for encode


@dataclass(kw_only=True)
class TrackingSection:
    """MLflow: a local SQLite store under the work dir unless a server is named."""

    uri: str = op("")  # "" = $MLFLOW_TRACKING_URI, else sqlite:///<work_dir>/mlflow.db
    experiment: str = op("transformer-wmt14-ende")  # the MLflow experiment
    enabled: bool = op(True)  # false: nothing is logged to MLflow, and register registers nothing
    # Workers log metrics through a buffer a background thread delivers (pipeline.tracking): an
    # outage of the server up to this long loses nothing; past it the oldest points are dropped
    # (counted in the run's tag tracking/dropped_points).
    buffer_s: float = op(1800.0)
    # The driver's bookkeeping (creating, continuing and ending runs) waits this long for the
    # server, then fails naming it.
    timeout_s: float = op(300.0)

    def validate(self) -> None:
        _check(self.buffer_s >= 0, "tracking.buffer_s", "must be >= 0")
        _check(self.timeout_s > 0, "tracking.timeout_s", "must be > 0")


@dataclass(kw_only=True)
class Config:
    data: DataSection = field(default_factory=DataSection)
    vocab: VocabSection = field(default_factory=VocabSection)
    model: ModelSection = field(default_factory=ModelSection)
    train: TrainSection = field(default_factory=TrainSection)
    speed: SpeedSection = field(default_factory=SpeedSection)
    workers: WorkersSection = field(default_factory=WorkersSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    metrics: MetricsSection = field(default_factory=MetricsSection)
    plan: PlanSection = field(default_factory=PlanSection)
    average: AverageSection = field(default_factory=AverageSection)
    decode: DecodeSection = field(default_factory=DecodeSection)
    score: ScoreSection = field(default_factory=ScoreSection)
    dev_bleu: DevBleuSection = field(default_factory=DevBleuSection)
    run: RunSection = field(default_factory=RunSection)
    tracking: TrackingSection = field(default_factory=TrackingSection)

    def validate(self) -> "Config":
        for f in dataclasses.fields(self):
            section = getattr(self, f.name)
            check_allowed(section, f"{f.name}.")
            if hasattr(section, "validate"):
                section.validate()
        _check(self.checkpoint.num_to_keep >= self.average.checkpoints, "checkpoint.num_to_keep",
               f"must be >= average.checkpoints ({self.average.checkpoints}) so averaging has its checkpoints")
        _check(not (self.train.early_stop_patience and self.train.early_stop_metric == "dev_bleu")
               or self.dev_bleu.enabled, "train.early_stop_metric",
               "'dev_bleu' needs dev_bleu.enabled = true (or use 'val_loss')")
        self._check_no_credentials()
        return self

    def _check_no_credentials(self) -> None:
        """Config values are logged to MLflow and saved beside every output: no secrets in them."""
        for section, values in self.to_dict().items():
            for key, value in values.items():
                for v in value if isinstance(value, list) else [value]:
                    _check(not (isinstance(v, str) and _CREDENTIALS_IN_URI.match(v)), f"{section}.{key}",
                           "embeds credentials in a URI (scheme://user:secret@...); give them through "
                           "the environment instead (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, "
                           "MLFLOW_TRACKING_USERNAME/MLFLOW_TRACKING_PASSWORD, ...)")

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Section -> key -> value. An unset (None) value is left out, as in a config file (TOML
        has no None): the dict reads back (`from_dict`) and prints as TOML (MLflow's resolved.toml)."""
        return {name: {k: v for k, v in values.items() if v is not None}
                for name, values in dataclasses.asdict(self).items()}

    def section_for_cache(self, name: str) -> dict[str, Any]:
        """The values of one section that change a stage's output (``cache=False`` fields left out),
        spelled as the keys of work dirs already on disk spell them (`migrations.cache_value`)."""
        section = getattr(self, name)
        return {f.name: cache_value(getattr(section, f.name))
                for f in dataclasses.fields(section)
                if f.metadata.get("cache", True) is True
                or (f.metadata.get("cache") == "if_set" and getattr(section, f.name) != _default(f))}


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


# scheme://<anything but / ? # @>@...: a user, a key or a user:secret pair before the host.
_CREDENTIALS_IN_URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://[^/?#@\s]+@")
