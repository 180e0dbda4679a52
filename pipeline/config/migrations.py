"""Every rule that keeps what was made before a change usable, in one place.

A work dir's stages are cached by keys made from the config (`pipeline.dag.compute_keys`); when
the config or the DAG changes, these rules keep the keys of work dirs already on disk valid:

- `keyed_if_set`: a field added later, whose default is the behaviour runs had before it, is in
  the key only when it is set to something else (so adding it changes no existing key);
- `cache_value`: an unset (None) value is keyed as 0, the spelling of "unset" in the keys made
  before `model.d_k` / `model.d_v` could be None;
- `FORMERLY_READS`: config keys a stage's key read under an earlier rule; a work dir whose stage
  finished under the key that rule gives is used as it is (`pipeline.dag.keys_in_work_dir`);
- `CACHE_SPELLING`: a keyed setting that moved is spelled in the key as it was before it moved
  (``decode.beam_size`` as ``eval.beam_size``), so moving it changes no key.

And a config file written before a key moved to another section is refused naming the key's new
place (`MOVED_KEYS`), never read into the wrong section; a config dict saved before (a run
record) is read with its moved keys in their new places (`moved_to_new_places`).
"""

from __future__ import annotations

from dataclasses import field
from typing import Any


def keyed_if_set(default: Any) -> Any:
    """A field in the cache key only when it differs from its default (`default` = the behaviour
    runs had before the field existed): adding it changes no existing key."""
    if isinstance(default, list):  # a mutable default: each config gets its own copy
        return field(default_factory=lambda: list(default), metadata={"cache": "if_set"})
    return field(default=default, metadata={"cache": "if_set"})


def cache_value(value: Any) -> Any:
    """A config value as the cache key spells it: None (unset) as 0."""
    return 0 if value is None else value


# Stage -> config keys its cache key read under an earlier rule. download keyed data.mirror for
# every source; now only for WMT14 (a Multi30k file is checked against its pinned sha256 wherever
# it comes from).
FORMERLY_READS: dict[str, tuple[str, ...]] = {"download": ("data.mirror",)}

# The evaluation settings, once one [eval] section, now one section per job: which checkpoints
# are averaged, how translate decodes, what score scores, dev BLEU while training.
EVAL_MOVED: dict[str, str] = {
    "eval.average_last": "average.checkpoints", "eval.average_select": "average.select",
    **{f"eval.{k}": f"decode.{k}" for k in (
        "beam_size", "alpha", "max_len_a", "max_len_b", "batch_tokens", "num_workers", "use_gpu",
        "threads_per_worker", "backend", "ct2_quantization")},
    **{f"eval.{k}": f"score.{k}" for k in ("splits", "max_sentences", "attention_sentences")},
    "eval.dev_bleu": "dev_bleu.enabled",
    **{f"eval.dev_bleu_{k}": f"dev_bleu.{k}" for k in ("sentences", "engine", "quantization", "beam_size",
                                                       "resources")},
}

# Settings of speed, workers, checkpoint, metrics and plan spelled as train keys, and the former
# [eval] keys: the loader refuses each naming its place (``train.precision is now speed.precision``),
# so none is dropped unsaid.
MOVED_KEYS: dict[str, str] = {
    **{f"train.{k}": f"speed.{k}" for k in (
        "precision", "max_tokens_per_batch", "prefetch", "compile", "compile_backend", "shape_buckets",
        "attention_backend", "fused_loss", "grad_compression")},
    **{f"train.{k}": f"workers.{k}" for k in (
        "num_workers", "elastic_resize_interval_s", "use_gpu", "cpus_per_worker", "placement_strategy",
        "max_failures", "corpus_cache_dir", "preemption_grace_s", "controller_poll_s")},
    "train.checkpoint_interval_steps": "checkpoint.interval_steps",
    "train.checkpoint_interval_s": "checkpoint.interval_s",
    "train.keep_checkpoints": "checkpoint.num_to_keep",
    "train.checkpoint_upload": "checkpoint.upload",
    "train.checkpoint_upload_retry_s": "checkpoint.upload_retry_s",
    "train.log_interval_steps": "metrics.log_interval_steps",
    "train.eval_interval_steps": "metrics.val_loss_interval_steps",
    **{f"train.{k}": f"plan.{k}" for k in ("gpu_type", "mfu_from", "assumed_mfu")},
    **EVAL_MOVED,
}

# New place -> the spelling of the stage keys made before the move (pipeline.stage.Stage.key_material).
CACHE_SPELLING: dict[str, str] = {new: old for old, new in EVAL_MOVED.items()}


def moved_to_new_places(data: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """A config dict (section -> key -> value) with each moved key in its new place."""
    out: dict[str, dict[str, Any]] = {}
    for section, values in data.items():
        if not isinstance(values, dict):  # not a table: the loader names it
            out[section] = values
            continue
        for key, value in values.items():
            new_section, new_key = MOVED_KEYS.get(f"{section}.{key}", f"{section}.{key}").split(".", 1)
            out.setdefault(new_section, {})[new_key] = value
    return out
