"""Which checkpoints `average` averages, and whether a run can produce them (no torch, no Ray).

``average.select``:
- ``"last"``: the last ``average.checkpoints`` kept checkpoints (§6.1: the last 5 for base).
- ``"best_dev_bleu"``: the ``average.checkpoints`` kept checkpoints with the highest dev sacreBLEU
  (``pipeline.decoding.dev_bleu_records``), averaged in step order. fairseq's ``--best-checkpoint-metric
  bleu`` and Marian's validation BLEU pick checkpoints the same way. Ties go to the later step.

``plan_check`` runs at ``--plan`` time (``workflows/runner.py``): a config whose training cannot
produce the checkpoints averaging needs is refused before any training, with the keys named; with
early stopping, that includes a run that stops as early as its patience allows (``early_stop_check``).
"""

from __future__ import annotations

from typing import Any

from pipeline.config import Config, ConfigError


def select_last(checkpoints: list[str], average_last: int) -> list[str]:
    """The last ``average_last`` of ``checkpoints`` (oldest first); too few is a ValueError."""
    if len(checkpoints) < average_last:
        raise ValueError(
            f"average.checkpoints = {average_last} but train kept only {len(checkpoints)} "
            f"checkpoint(s) ({', '.join(checkpoints) or 'none'}). §6.1 averages the last 5: train "
            f"longer / keep more (checkpoint.num_to_keep), or say --average.checkpoints={max(len(checkpoints), 1)} "
            f"to average what exists.")
    return list(checkpoints[-average_last:])


def select_best(checkpoints: list[str], scores: dict[str, float], average_last: int) -> list[str]:
    """The ``average_last`` checkpoints with the highest score (``scores``: uri -> dev BLEU), in
    their original (step) order. Every checkpoint must have a score: one without is a ValueError
    naming it (the average stage scores missing ones before it selects)."""
    select_last(checkpoints, average_last)  # the same "too few" error
    missing = [c for c in checkpoints if c not in scores]
    if missing:
        raise ValueError(f"average.select = 'best_dev_bleu': no dev BLEU for {', '.join(missing)}")
    order = {c: i for i, c in enumerate(checkpoints)}
    best = sorted(checkpoints, key=lambda c: (scores[c], order[c]), reverse=True)[:average_last]
    return sorted(best, key=order.__getitem__)


def step_checkpoints(max_steps: int, interval_steps: int) -> int:
    """How many checkpoints the step interval alone writes: every multiple of it, and the last step."""
    return max_steps // interval_steps + (1 if max_steps % interval_steps else 0)


def plan_check(cfg: Config) -> str | None:
    """Refuse (ConfigError naming the keys) a config whose training cannot leave
    ``average.checkpoints`` checkpoints for `average`; with time-based checkpoints (which the plan
    cannot count) return a note of what is expected, checked again when train ends
    (``expected_checkpoints_note``). None when the step interval alone provides them."""
    t, ck, need = cfg.train, cfg.checkpoint, cfg.average.checkpoints
    made = step_checkpoints(t.max_steps, ck.interval_steps)
    if made >= need:
        return early_stop_check(cfg)
    if ck.interval_s > 0:
        return (f"expects {made} step checkpoint(s) (train.max_steps = {t.max_steps}, "
                f"checkpoint.interval_steps = {ck.interval_steps}) plus one per "
                f"checkpoint.interval_s = {ck.interval_s:g} s; average.checkpoints = {need} "
                "needs the time-based ones: checked when train ends")
    raise ConfigError(
        f"train.max_steps = {t.max_steps} with checkpoint.interval_steps = {ck.interval_steps} "
        f"writes {made} checkpoint(s), but average.checkpoints = {need} averages {need}: lower "
        f"average.checkpoints, lower checkpoint.interval_steps (<= {t.max_steps // need}), or set "
        "checkpoint.interval_s")


def early_stop_check(cfg: Config) -> str | None:
    """With early stopping (``train.early_stop_patience``): refuse (ConfigError naming the keys) a
    config whose run may stop before it has written ``average.checkpoints`` checkpoints; return a
    note when the best checkpoint will have been rotated out by the time the run stops.

    The earliest stop is after patience + 1 validations (the first sets the best): for val_loss at
    step (patience + 1) x metrics.val_loss_interval_steps, which has written the step checkpoints up to
    it and the stop's own; for dev_bleu after patience + 1 validated checkpoints (at least that many)."""
    t, ck, need = cfg.train, cfg.checkpoint, cfg.average.checkpoints
    if not t.early_stop_patience:
        return None
    if t.early_stop_metric == "val_loss":
        first_stop = min((t.early_stop_patience + 1) * cfg.metrics.val_loss_interval_steps, t.max_steps)
        made = step_checkpoints(first_stop, ck.interval_steps)  # the stop's own included
    else:
        made = t.early_stop_patience + 1
    if made < need and ck.interval_s <= 0:
        raise ConfigError(
            f"train.early_stop_patience = {t.early_stop_patience} ({t.early_stop_metric}) may stop the run after "
            f"{made} checkpoint(s), but average.checkpoints = {need} averages {need}: raise train.early_stop_patience, "
            "lower average.checkpoints" + (", or lower checkpoint.interval_steps"
                                         if t.early_stop_metric == "val_loss" else ""))
    if t.early_stop_patience >= ck.num_to_keep:
        return (f"early stopping: train.early_stop_patience = {t.early_stop_patience} >= checkpoint.num_to_keep = "
                f"{ck.num_to_keep}: when the run stops, its best checkpoint has been rotated out (average "
                "gets the last ones)")
    return None


def kept_shortfall(cfg: Config, num_kept: int) -> str | None:
    """After training: why `average` will fail on ``num_kept`` checkpoints (keys named), or None."""
    need = cfg.average.checkpoints
    if num_kept >= need:
        return None
    return (f"train kept {num_kept} checkpoint(s) but average.checkpoints = {need}: the average stage will "
            f"refuse; checkpoint.interval_s = {cfg.checkpoint.interval_s:g} s and "
            f"checkpoint.interval_steps = {cfg.checkpoint.interval_steps} made too few in "
            f"{cfg.train.max_steps} steps")


def describe(chosen: list[str], scores: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per checkpoint for reports: {"checkpoint", "dev_bleu", "averaged"}."""
    picked = set(chosen)
    return [{"checkpoint": c, "dev_bleu": scores.get(c), "averaged": c in picked} for c in scores]
