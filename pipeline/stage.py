"""What a stage is: a function ``run(ctx) -> StageResult`` over paths, plus what its cache key reads.

The DAG itself (which stages, in which order, reading what) is the table in ``pipeline/dag.py``.
The runner (``workflows/runner.py``) computes keys, decides what runs, gives each running stage a
fresh output folder ``<work_dir>/<stage>/<key>/`` and writes the stage's manifest there last.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

from pipeline.config import Config
from pipeline.config.migrations import CACHE_SPELLING, FORMERLY_READS

log = logging.getLogger(__name__)

MANIFEST = "_manifest.json"


class NotImplementedStage(RuntimeError):
    """The stage exists in the DAG but has no implementation yet: it is reported, never faked."""


class NullTracker:
    """Logs nothing (tracking disabled, and unit tests). Its methods and attributes are what a stage
    may log through ``ctx.tracker`` (the runner gives it an MLflow-backed one, a
    ``pipeline.tracking.RunLogger``; tests may give a fake)."""

    run_id = None
    tracking_uri = None

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        pass

    def log_params(self, params: dict[str, Any]) -> None:
        pass

    def log_text(self, text: str, artifact_file: str) -> None:
        pass

    def log_artifact(self, local_path: str, artifact_path: str | None = None) -> None:
        pass

    def set_tags(self, tags: dict[str, str]) -> None:
        pass


@dataclass(kw_only=True)
class Manifest:
    """A finished stage: where its files are, and what it recorded about them."""

    stage: str
    key: str
    dir: str  # URI of <work_dir>/<stage>/<key>
    outputs: dict[str, Any]  # stage-specific, JSON-able (file lists, ids, paths)
    metrics: dict[str, float] = field(default_factory=dict)
    files: list[dict[str, Any]] = field(default_factory=list)  # [{path, bytes, sha256}]
    extra: dict[str, Any] = field(default_factory=dict)  # config, upstream keys, timings, versions

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Manifest":
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})


@dataclass(kw_only=True)
class StageContext:
    """Everything a running stage gets."""

    name: str
    key: str
    cfg: Config
    out_dir: str  # URI, empty when a stage starts (except resumable ones, e.g. train)
    inputs: dict[str, Manifest]  # upstream stage name -> its manifest
    tracker: Any = field(default_factory=NullTracker)


@dataclass
class StageResult:
    outputs: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class Stage:
    name: str
    version: str  # bump when the stage's code changes its output
    reads: tuple[str, ...]  # config sections ("vocab") or single keys ("data.mirror") in the key
    upstream: tuple[str, ...]
    impl: str  # "module:function", imported only when the stage runs
    resumable: bool = False  # keep a partial output folder on rerun (train resumes from it)
    forget: str | None = None  # "module:function(cfg, key)" that drops resumable state when forced
    checksum_files: bool = True  # sha256 every output file in the manifest
    resume: str | None = None  # "module:function(cfg, key)" -> (what a rerun does, when) for --plan
    # Keys read only in one mode: ((key, value, extra reads), ...) adds the extra reads when
    # cfg's `key` equals `value` (so the other modes keep the keys they had).
    reads_if: tuple[tuple[str, Any, tuple[str, ...]], ...] = ()

    @property
    def formerly_reads(self) -> tuple[str, ...]:
        """Keys the stage's cache key read under an earlier rule that no longer reads them
        (`pipeline.config.migrations.FORMERLY_READS`): an output finished under the key that rule
        gives is still used (``pipeline.dag.keys_in_work_dir``)."""
        return FORMERLY_READS.get(self.name, ())

    def load(self) -> Callable[[StageContext], StageResult]:
        return self._resolve(self.impl)

    def forget_state(self, cfg: Config, key: str) -> None:
        """Drop a resumable stage's state (e.g. train's Ray Train run) so it starts from scratch."""
        if self.forget:
            self._resolve(self.forget)(cfg, key)

    def resume_point(self, cfg: Config, key: str) -> tuple[str, float] | None:
        """Where an interrupted run of a resumable stage stands, e.g. ("will resume from step 10
        (checkpoint checkpoint_0000010)", mtime); None when it has no partial state."""
        return self._resolve(self.resume)(cfg, key) if self.resume else None

    def _resolve(self, spec: str) -> Callable[..., Any]:
        module_name, func_name = spec.split(":")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name == module_name:
                raise NotImplementedStage(f"stage '{self.name}' is not implemented ({module_name} missing)") from e
            raise
        fn = getattr(module, func_name, None)
        if fn is None:
            raise NotImplementedStage(f"stage '{self.name}' is not implemented ({spec} missing)")
        return fn

    def key_material(self, cfg: Config, former: bool = False) -> dict[str, Any]:
        """The config values this stage reads (operational ``cache=False`` fields left out);
        ``former``: as the earlier rule read them (``formerly_reads`` too)."""
        out: dict[str, Any] = {}
        reads = list(self.reads)
        for key, value, extra in self.reads_if:
            section, name = key.split(".", 1)
            if getattr(getattr(cfg, section), name) == value:
                reads += [r for r in extra if r not in reads]
        if former:
            reads += [r for r in self.formerly_reads if r not in reads]
        for item in reads:
            if "." in item:
                section, key = item.split(".", 1)
                values = cfg.section_for_cache(section)
                if key in values or not _is_keyed_if_set(cfg, section, key):  # an unset one: out of the key
                    out[CACHE_SPELLING.get(item, item)] = values[key]  # a moved key as it was spelled
            else:
                out[item] = cfg.section_for_cache(item)
        return out


def _is_keyed_if_set(cfg: Config, section: str, key: str) -> bool:
    """Whether ``section.key`` is a `keyed_if_set` field (at its default it is left out of the key,
    as it was before the field existed)."""
    f = {f.name: f for f in dataclasses.fields(getattr(cfg, section))}[key]
    return f.metadata.get("cache") == "if_set"
