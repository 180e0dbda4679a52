"""The train stage's inputs and budgets, checked on the driver before any worker starts.

`preflight` refuses what cannot train (no shards, an empty split, ids outside the vocabulary, a
`train.max_len` beyond the model's positions, budgets smaller than the longest pair) with a
`TrainInputError` that names the setting or the folder, and returns the epoch's statistics for the
stage's log and outputs. `check_early_stop` refuses an early-stop rule whose metric this run will
not have. Both run in seconds on the training split's lengths, so a wrong input never costs a
worker's start-up (or a GPU's hour).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from model import ModelConfig
from pipeline.batch_plan import step_groups
from pipeline.batch_plan.step_groups import worker_range
from pipeline.config import Config
from pipeline.train import dev_bleu_validation
from pipeline.train.corpus import id_range, shard_files

log = logging.getLogger(__name__)


class TrainInputError(ValueError):
    """The training inputs or budgets cannot work; raised before any worker starts."""


def preflight(cfg: Config, mc: ModelConfig, train_dir: str, dev_dir: str,
              lengths: tuple[np.ndarray, np.ndarray]) -> dict[str, Any]:
    """Fail fast with a clear message; return data statistics for the log and the outputs.
    ``lengths``: the training split's (src_len, tgt_len) (``corpus.load_lengths``)."""
    tc = cfg.train
    if not shard_files(train_dir):
        raise TrainInputError(f"train: no Parquet shards in the training split {train_dir}")
    src_len, tgt_len = lengths
    if len(src_len) == 0:
        raise TrainInputError(f"train: the training split {train_dir} is empty (0 pairs)")
    keep = step_groups.keep_mask(src_len, tgt_len, tc.max_len)
    if not keep.any():
        raise TrainInputError(f"train: all {len(src_len)} training pairs are longer than "
                              f"train.max_len={tc.max_len} pieces (or empty): nothing to train on")
    for split, uri in (("train", train_dir), ("dev", dev_dir)):
        rng = id_range(uri) if uri else None
        if rng is not None and (rng[0] < 0 or rng[1] >= mc.vocab_size):
            raise TrainInputError(f"train: the {split} shards in {uri} hold ids in [{rng[0]}, {rng[1]}] but the "
                                  f"vocabulary has {mc.vocab_size} ids: were they encoded with another "
                                  "SentencePiece model?")
    if tc.max_len + 1 > mc.max_positions:
        raise TrainInputError(f"train.max_len={tc.max_len} (+1 special token) exceeds "
                              f"model.max_positions={mc.max_positions}")
    longest_tgt = int(step_groups.target_tokens(tgt_len[keep]).max())
    if tc.tokens_per_step < longest_tgt:
        raise TrainInputError(f"train.tokens_per_step={tc.tokens_per_step} is smaller than one training pair "
                              f"({longest_tgt} target tokens with eos): a step must hold at least a sentence")
    longest_padded = int(step_groups.padded_len(src_len[keep], tgt_len[keep]).max())
    if cfg.speed.max_tokens_per_batch < longest_padded:
        raise TrainInputError(f"speed.max_tokens_per_batch={cfg.speed.max_tokens_per_batch} is smaller than the "
                              f"longest kept pair ({longest_padded} padded tokens): raise it or lower train.max_len")
    return epoch_statistics(cfg, keep, lengths)


def epoch_statistics(cfg: Config, keep: np.ndarray, lengths: tuple[np.ndarray, np.ndarray]) -> dict[str, Any]:
    """What the first epoch's plan holds (pairs kept and dropped, steps, tokens and micro-batches per
    step), logged; ``keep``: the pairs within ``train.max_len``."""
    tc, (src_len, tgt_len) = cfg.train, lengths
    num_kept = int(keep.sum())
    plan = step_groups.plan_epoch(np.flatnonzero(keep), src_len, tgt_len, tc.tokens_per_step, tc.seed, 0)
    # With a range, the smallest group: the most micro-batches per worker (workers split each step
    # by the world size they have at each (re)start, never by this number).
    workers, most_workers = worker_range(cfg)
    accum = [step_groups.split_step(g, src_len, tgt_len, workers, cfg.speed.max_tokens_per_batch).accum
             for g in plan[:50]]
    stats = {"num_pairs": len(src_len), "num_kept": num_kept, "num_dropped_too_long": len(src_len) - num_kept,
             "steps_per_epoch": len(plan), "mean_tgt_tokens_per_step":
             float(np.mean([step_groups.target_tokens(tgt_len[g]).sum() for g in plan])),
             "mean_pairs_per_step": float(np.mean([len(g) for g in plan])), "accum_mean": float(np.mean(accum)),
             "accum_max": int(max(accum))}
    log.info("train: %d pairs, %d kept, %d dropped as longer than train.max_len=%d pieces", len(src_len),
             num_kept, stats["num_dropped_too_long"], tc.max_len)
    log.info("train: %d steps per epoch, %.0f target tokens and %.0f pairs per step; %d worker(s) x "
             "%.1f micro-batch(es) on average (max %d) under %d padded tokens each", len(plan),
             stats["mean_tgt_tokens_per_step"], stats["mean_pairs_per_step"], workers,
             stats["accum_mean"], stats["accum_max"], cfg.speed.max_tokens_per_batch)
    if stats["mean_pairs_per_step"] < most_workers:
        log.warning("train: fewer pairs per step (%.1f) than workers (%d): some workers idle each step",
                    stats["mean_pairs_per_step"], most_workers)
    return stats


def check_early_stop(cfg: Config, dev_dir: str, vocab: dict[str, Any]) -> None:
    """Early stopping's metric must exist for this run (before any worker starts)."""
    tc = cfg.train
    if not tc.early_stop_patience:
        return
    why = (dev_bleu_validation.unavailable(cfg, dev_dir, vocab) if tc.early_stop_metric == "dev_bleu"
           else None if dev_dir else "the encode stage has no dev split")
    if why:
        raise TrainInputError(f"train.early_stop_patience = {tc.early_stop_patience} on "
                              f"train.early_stop_metric = '{tc.early_stop_metric}', but this run has no such metric: {why}")
    log.info("train: early stopping after %d validation(s) without improvement of %s", tc.early_stop_patience,
             tc.early_stop_metric)
