"""The DAG runner: cache keys, the plan (what runs and why), and running the stages in order.

A stage's key hashes its name, version, the config values it reads and its upstream keys. Its
outputs live in ``<work_dir>/<stage>/<key>/`` and it is done only when ``_manifest.json`` (written
last, atomically) is there, records the same key, and records the upstream manifests it was built
from. A half-written stage is never taken as done; a stage whose upstream was rerun is stale.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from pipeline import storage
from pipeline.config import Config
from pipeline.dag import (BY_NAME, ORDER, STAGES, downstream, keys_in_work_dir, manifest_digest, read_manifest,
                          stage_dir, upstream_closure)
from pipeline.dag import compute_keys  # noqa: F401 - re-exported (the sweep, tests)
from pipeline.stage import MANIFEST, Manifest, NotImplementedStage, Stage, StageContext

log = logging.getLogger(__name__)

LATEST = "_latest.json"  # <work_dir>/<stage>/_latest.json: the last key run, to explain changes


class PlanError(RuntimeError):
    """The requested selection cannot run (e.g. ``--only`` without cached inputs)."""


@dataclass(kw_only=True)
class StagePlan:
    stage: Stage
    key: str
    out_dir: str
    action: str  # "cached" | "run" | "skip"
    reason: str
    forced: bool = False  # rerun from scratch even if a resumable stage has partial state
    manifest: Manifest | None = None  # the cached manifest, read once while planning


def _changed_keys(cfg: Config, stage: Stage) -> str:
    """Name the config values that changed since this stage last ran (from its _latest.json)."""
    try:
        latest = storage.read_json(storage.join(storage.absolute(cfg.run.work_dir), stage.name, LATEST))
    except (FileNotFoundError, OSError, json.JSONDecodeError):
        return "never ran with this config"
    before, now = latest.get("config", {}), stage.key_material(cfg)
    changes = []
    for item, value in now.items():
        old = before.get(item)
        if isinstance(value, dict) and isinstance(old, dict):
            changes += [f"{item}.{k}: {old.get(k)!r} -> {v!r}" for k, v in value.items() if old.get(k) != v]
        elif old != value:
            changes.append(f"{item}: {old!r} -> {value!r}")
    return "config changed (" + "; ".join(changes) + ")" if changes else "an upstream stage's key changed"


def _interrupted(cfg: Config, stage: Stage, key: str, out_dir: str, busy: str | None = None) -> str | None:
    """A run of this very key started and never wrote its manifest (a killed driver, a failure):
    say when it last wrote and what a rerun does; None when it never started. With `busy` (the
    driver that holds the work dir now) the stage may simply be running: say so instead."""
    point = stage.resume_point(cfg, key)  # train: its Ray Train run, where the checkpoints are
    when = point[1] if point is not None else storage.last_modified(out_dir)
    if when is None:
        return None
    if busy:
        return (f"unfinished (output from {_local_time(when)}); the work dir is in use by {busy}, "
                "which may be running it")
    if point is not None:
        return f"interrupted (partial output from {_local_time(when)}), {point[0]}"
    return f"interrupted (partial output from {_local_time(when)}, will rerun)"


def _local_time(epoch_s: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(epoch_s))


def make_plan(cfg: Config, only: str | None = None, from_: str | None = None,
              force: tuple[str, ...] = (), to: str | None = None, busy: str | None = None) -> list[StagePlan]:
    """What runs and why. `busy`: the driver holding the work dir (``--plan`` during a run)."""
    for name in (only, from_, to, *force):
        if name is not None and name not in BY_NAME:
            raise PlanError(f"unknown stage '{name}' (stages: {', '.join(ORDER)})")
    keys = keys_in_work_dir(cfg)
    forced: dict[str, str] = {}
    for f in force:
        for d in downstream(f):
            forced.setdefault(d, f"forced (--force {f})" if d == f else f"downstream of forced '{f}'")
    if from_:
        for d in downstream(from_):
            forced.setdefault(d, f"--from {from_}")
    if only:
        forced.setdefault(only, f"--only {only}")
    selected = [only] if only else (downstream(from_) if from_ else ORDER)
    if to:
        selected = [n for n in selected if n in (*upstream_closure(to), to)]

    plans: list[StagePlan] = []
    digests: dict[str, str | None] = {}  # current upstream manifest digests (None = will rerun)
    for s in STAGES:
        out_dir = stage_dir(cfg, s.name, keys[s.name])
        manifest = read_manifest(out_dir, keys[s.name])
        recorded = (manifest.extra.get("upstream_digests", {}) if manifest else {})
        stale = [u for u in s.upstream if digests.get(u) is None or recorded.get(u) != digests[u]]
        if s.name in forced and s.name in selected:
            action, reason = "run", forced[s.name]
        elif manifest is None:
            action, reason = "run", ((_interrupted(cfg, s, keys[s.name], out_dir, busy) or _changed_keys(cfg, s))
                                     if s.name in selected else "not cached")
        elif stale:
            action, reason = "run", f"stale: upstream {', '.join(stale)} changed since it ran"
        else:
            action, reason = "cached", f"done ({manifest.extra.get('finished', '?')})"
        if s.name not in selected and action == "run":
            action = "skip"
        plans.append(StagePlan(stage=s, key=keys[s.name], out_dir=out_dir, action=action, reason=reason,
                               forced=action == "run" and s.name in forced,
                               manifest=manifest if action == "cached" else None))
        digests[s.name] = manifest_digest(manifest) if (manifest and action == "cached") else None
    _check_inputs(plans, selected)
    _check_checkpoints(cfg, plans)
    return plans


def _check_checkpoints(cfg: Config, plans: list[StagePlan]) -> None:
    """Before any training: can the train run about to start leave what `average` needs?"""
    from pipeline.decoding.selection import plan_check

    by_name = {p.stage.name: p for p in plans}
    if by_name["train"].action == "run" and by_name["average"].action != "skip":
        note = plan_check(cfg)  # a ConfigError naming the keys when the step interval decides
        if note:
            by_name["train"].reason += f"; {note}"


def _check_inputs(plans: list[StagePlan], selected: list[str]) -> None:
    """Stages outside the selection are not run for you: their outputs must already exist."""
    by_name = {p.stage.name: p for p in plans}
    needed: set[str] = set()
    for p in plans:
        if p.action == "run":
            needed.update(p.stage.upstream)
    for name in sorted(needed, key=ORDER.index):
        p = by_name[name]
        if p.action == "skip":
            raise PlanError(
                f"stage '{name}' has no usable cached output for this config (key {p.key}: {p.reason}), "
                f"and {', '.join(s for s in selected)} needs it; run without --only, or with --from {name}")


def format_plan(plans: list[StagePlan]) -> str:
    width = max(len(p.stage.name) for p in plans)
    rows = [f"{'stage':<{width}}  {'key':<16}  {'action':<7}  why"]
    for p in plans:
        rows.append(f"{p.stage.name:<{width}}  {p.key:<16}  {p.action:<7}  {p.reason}")
    return "\n".join(rows)


def format_bill(cfg: Config, plans: list[StagePlan], mfu_from: str = "") -> str:
    """The train stage's bill for ``--plan``: at the cached vocab's size and the cached encode
    stage's training lengths when there are, else at ``vocab.size`` and stated assumed lengths.
    This CPU's bill (pipeline/plan/cpu_bill.py) when the run trains on it, else the GPUs'
    (pipeline/plan/bill.py)."""
    from pipeline.models import model_config_for
    from pipeline.train.corpus import load_lengths
    from pipeline.plan.train_bill import train_bill
    from pipeline.train.driver import local_cpu_training

    by_name = {p.stage.name: p for p in plans}
    vocab, encode = by_name["vocab"].manifest, by_name["encode"].manifest
    mc = model_config_for(cfg, vocab.outputs if vocab else {"vocab_size": cfg.vocab.size})
    lengths = load_lengths(encode.outputs["splits"]["train"]["dir"]) if encode else None
    return train_bill(cfg, mc, lambda: local_cpu_training(cfg), lengths, mfu_from, shapes=True).format()


def _file_list(out_dir: str, checksum: bool) -> list[dict[str, Any]]:
    files = []
    for rel, size in storage.list_files(out_dir):
        if rel == MANIFEST or rel.rsplit("/", 1)[-1].startswith("."):
            continue
        entry: dict[str, Any] = {"path": rel, "bytes": size}
        if checksum:
            entry["sha256"] = storage.sha256(storage.join(out_dir, rel))
        files.append(entry)
    return files


def run_stage(cfg: Config, p: StagePlan, fn, inputs: dict[str, Manifest], tracker) -> Manifest:
    if p.forced and p.stage.forget:
        p.stage.forget_state(cfg, p.key)
        log.info("stage %s: forced, dropped its resumable state", p.stage.name)
    if not p.stage.resumable or p.forced:
        storage.rmtree(p.out_dir)
    storage.makedirs(p.out_dir)
    started = time.time()
    log.info("stage %s: running (key %s) -> %s", p.stage.name, p.key, p.out_dir)
    result = fn(StageContext(name=p.stage.name, key=p.key, cfg=cfg, out_dir=p.out_dir, inputs=inputs, tracker=tracker))
    wall_s = time.time() - started
    files = _file_list(p.out_dir, p.stage.checksum_files)
    manifest = Manifest(
        stage=p.stage.name, key=p.key, dir=p.out_dir, outputs=result.outputs,
        metrics=dict(result.metrics), files=files,
        extra={"version": p.stage.version, "config": p.stage.key_material(cfg),
               "resolved_config": cfg.to_dict(),
               "upstream_keys": {u: inputs[u].key for u in p.stage.upstream},
               "upstream_digests": {u: manifest_digest(inputs[u]) for u in p.stage.upstream},
               "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started)),
               "finished": time.strftime("%Y-%m-%dT%H:%M:%S"), "wall_s": round(wall_s, 3)})
    storage.write_json(storage.join(p.out_dir, MANIFEST), manifest.to_dict())  # last: marks done
    storage.write_json(storage.join(storage.absolute(cfg.run.work_dir), p.stage.name, LATEST),
                       {"key": p.key, "config": p.stage.key_material(cfg)})
    log.info("stage %s: done in %.1f s (%d files)", p.stage.name, wall_s, len(files))
    return manifest


def execute(cfg: Config, plans: list[StagePlan], tracking) -> dict[str, Manifest]:
    """Run the plan in order; returns the manifests of every cached or finished stage."""
    manifests: dict[str, Manifest] = {}
    for p in plans:
        if p.action == "skip":
            continue
        params = p.stage.key_material(cfg)
        if p.action == "cached":
            manifests[p.stage.name] = p.manifest
            with tracking.stage_run(p.stage.name, p.key, cached=True, params=params) as t:
                t.log_metrics(manifests[p.stage.name].metrics)
            log.info("stage %s: cached (key %s)", p.stage.name, p.key)
            continue
        try:
            fn = p.stage.load()  # before its MLflow run: a missing stage is reported, not recorded
        except NotImplementedStage as e:
            log.error("%s; stopping here (nothing after it runs)", e)
            raise
        inputs = {u: manifests[u] for u in p.stage.upstream}
        with tracking.stage_run(p.stage.name, p.key, cached=False, params=params, fresh=p.forced) as t:
            m = run_stage(cfg, p, fn, inputs, t)
            t.log_metrics({**m.metrics, "stage/wall_s": m.extra["wall_s"]})
            t.log_text(json.dumps(m.to_dict(), indent=2, default=str), "manifest.json")
        tracking.parent.log_metrics(m.metrics)
        manifests[p.stage.name] = m
    return manifests
