"""The DAG, as a table: download -> prepare -> vocab -> encode -> train -> average -> export -> translate -> score
-> register.

``export`` (HF Marian folder, CTranslate2 models) sits before ``translate`` because the
``decode.backend = "ctranslate2"`` path decodes with its CTranslate2 model.

Each row names the config values that go into the stage's cache key and the stages it reads.
The keys (``compute_keys``; ``keys_in_work_dir``, which keeps outputs made under a stage's earlier
key rule) and where a key's output lives (``stage_dir``, ``read_manifest``) are here too, in the
core: the runner plans with them, and ``pipeline/models.py`` finds a config's model with them.
The ``outputs`` each stage records in its manifest (what downstream stages rely on) are listed
in ``docs/stages.md``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from typing import Any, Collection

from pipeline import storage
from pipeline.config import Config, DecodeSettings
from pipeline.stage import MANIFEST, Manifest, Stage

log = logging.getLogger(__name__)

_DATA_SOURCE = ("data.source", "data.src_lang", "data.tgt_lang", "data.corpora",
                "data.train_src", "data.train_tgt", "data.dev_src", "data.dev_tgt",
                "data.test_src", "data.test_tgt")
# Where the files come from (data.mirror) decides the data only for WMT14: its archives are checked
# against the mirror's own SHA256SUMS, and the offline stand-in mirror holds samples, not statmt.org's
# bytes. Multi30k's files are each checked against the sha256 pinned in pipeline/data/sources.py, so
# a mirror cannot change them (an operational value, like download_timeout_s); "custom" reads none.
# Work dirs downloaded while every source keyed it are still used (config/migrations.py).
_MIRROR_IF_WMT14 = (("data.source", "wmt14", ("data.mirror",)),)
_CLEANING = ("data.preprocess", "data.max_words", "data.max_length_ratio", "data.dedup",
             "data.max_pairs_per_corpus", "data.num_shards")

# The beam search's keys: DecodeSettings' fields (decode.beam_size, decode.alpha, decode.max_len_a, decode.max_len_b).
_DECODE = tuple(f"decode.{f.name}" for f in dataclasses.fields(DecodeSettings))
# What decides a dev BLEU number (pipeline.decoding.dev_bleu.DevBleuSettings: dev_bleu.* and the
# decode keys).
_DEV_BLEU = ("average.select", "dev_bleu.sentences", "dev_bleu.engine",
             "dev_bleu.quantization", "dev_bleu.beam_size", *_DECODE)

STAGES: tuple[Stage, ...] = (
    Stage(name="download", version="1", reads=_DATA_SOURCE, upstream=(), impl="pipeline.data.download:run",
          checksum_files=False, reads_if=_MIRROR_IF_WMT14),
    Stage(name="prepare", version="1", reads=_CLEANING, upstream=("download",), impl="pipeline.data.prepare:run"),
    Stage(name="vocab", version="1", reads=("vocab",), upstream=("prepare",), impl="pipeline.data.vocab:run"),
    Stage(name="encode", version="1", reads=(), upstream=("prepare", "vocab"), impl="pipeline.data.encode:run"),
    Stage(name="train", version="1", reads=("model", "train"), upstream=("encode", "vocab"),
          impl="pipeline.train.driver:run",
          resumable=True, checksum_files=False, forget="pipeline.train.driver:forget_run",
          resume="pipeline.train.resume:resume_point"),
    # Selecting by dev BLEU reads the settings that decide those numbers ("last" keeps its key).
    Stage(name="average", version="1", reads=("average.checkpoints",), upstream=("train",),
          impl="pipeline.evaluate.average:run",
          reads_if=(("average.select", "best_dev_bleu", _DEV_BLEU),)),
    Stage(name="export", version="1", reads=(), upstream=("average", "vocab"), impl="pipeline.serve.export:run"),
    Stage(name="translate", version="1",
          reads=(*_DECODE, "score.splits", "score.max_sentences", "decode.backend", "decode.ct2_quantization"),
          upstream=("average", "encode", "vocab", "export"), impl="pipeline.evaluate.translate:run"),
    # The report names the pair and test set and picks its Table 2 row from data.* and model.*;
    # it reads the training facts from train and the averaged checkpoints from average, where they are made.
    # With data.preprocess it reads download's raw test reference for the sacreBLEU beside the benchmark's BLEU.
    # Version 2: sacreBLEU and chrF case-insensitive (-lc) for a preprocessed (lowercased) model.
    Stage(name="score", version="2",
          reads=("score.splits", "score.max_sentences", "data.source", "data.src_lang", "data.tgt_lang",
                         "data.dev_src", "data.test_src", "data.preprocess", "score.attention_sentences", "model"),
          upstream=("translate", "encode", "average", "train", "download", "vocab"),
          impl="pipeline.evaluate.score:run"),
    # The scored model as a version of the MLflow Model Registry (its files and its test scores).
    Stage(name="register", version="1", reads=(), upstream=("average", "vocab", "export", "score"),
          impl="pipeline.serve.register:run",
          checksum_files=False),
)

BY_NAME = {s.name: s for s in STAGES}
ORDER = [s.name for s in STAGES]


def downstream(name: str) -> list[str]:
    """``name`` and every stage that (transitively) reads it, in DAG order."""
    out = {name}
    for s in STAGES:
        if any(u in out for u in s.upstream):
            out.add(s.name)
    return [n for n in ORDER if n in out]


def upstream_closure(name: str) -> list[str]:
    """Every stage ``name`` (transitively) reads, in DAG order, without ``name`` itself."""
    out: set[str] = set()
    todo = list(BY_NAME[name].upstream)
    while todo:
        n = todo.pop()
        if n not in out:
            out.add(n)
            todo.extend(BY_NAME[n].upstream)
    return [n for n in ORDER if n in out]


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def compute_keys(cfg: Config, former: Collection[str] = ()) -> dict[str, str]:
    """Each stage's cache key from the config alone; the stages named in ``former`` keyed by their
    earlier rule (``Stage.formerly_reads``), and so the stages after them by their keys."""
    keys: dict[str, str] = {}
    for s in STAGES:
        material = {"stage": s.name, "version": s.version, "config": s.key_material(cfg, s.name in former),
                    "upstream": {u: keys[u] for u in s.upstream}}
        keys[s.name] = _digest(material)[:16]
    return keys


def keys_in_work_dir(cfg: Config) -> dict[str, str]:
    """The keys a run plans with and a lookup reads (the runner, ``pipeline/models.py``):
    ``compute_keys``, except where a stage has no finished output under its key but has one under
    the key its earlier rule gives (``Stage.formerly_reads``): that key is kept, and the keys of the
    stages after it follow from it, so a work dir made before the rule changed is used as it is
    (nothing is moved or rewritten). Reads only the manifests of stages with an earlier rule."""
    keys, former = compute_keys(cfg), set[str]()
    for s in STAGES:
        if not s.formerly_reads:
            continue
        old = compute_keys(cfg, former | {s.name})
        if (old[s.name] == keys[s.name] or read_manifest(stage_dir(cfg, s.name, keys[s.name]), keys[s.name])
                or not read_manifest(stage_dir(cfg, s.name, old[s.name]), old[s.name])):
            continue
        log.info("stage %s: using its output under key %s, the key its earlier rule gives (it read %s); "
                 "a fresh work dir uses key %s", s.name, old[s.name], ", ".join(s.formerly_reads), keys[s.name])
        former.add(s.name)
        keys = old
    return keys


def stage_dir(cfg: Config, stage: str, key: str) -> str:
    return storage.join(storage.absolute(cfg.run.work_dir), stage, key)


def manifest_digest(m: Manifest) -> str:
    """What downstream stages remember of an upstream manifest, to notice a rerun."""
    return _digest({"key": m.key, "outputs": m.outputs, "files": m.files})


def read_manifest(out_dir: str, key: str) -> Manifest | None:
    uri = storage.join(out_dir, MANIFEST)
    try:
        data = storage.read_json(uri)
    except (FileNotFoundError, OSError, json.JSONDecodeError):
        return None
    if data.get("key") != key:
        return None
    return Manifest.from_dict(data)
