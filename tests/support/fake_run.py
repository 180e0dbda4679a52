"""Finished stages without their work: the real runner (``workflows/runner.py``) writes each
stage's output folder and manifest for a config, with outputs the test chooses.

    fake_run(cfg, {"vocab": {"model": spm}, "average": {...}}, to="export")

For tests of what reads a work dir by the DAG's plan (``pipeline/models.py``): the manifests,
keys and upstream digests are the runner's own, not a copy of them.
"""

from __future__ import annotations

from typing import Any

from pipeline.stage import NullTracker, StageResult
from workflows import runner


def fake_run(cfg: Any, outputs: dict[str, dict[str, Any]], to: str, force: tuple[str, ...] = ()) -> dict:
    """Run every stage up to ``to`` (those not cached, or forced) with a function that returns
    ``outputs[stage]`` (default {}); returns the manifests by stage."""
    manifests = {}
    for p in runner.make_plan(cfg, to=to, force=force):
        if p.action == "cached":
            manifests[p.stage.name] = p.manifest
        elif p.action == "run":
            result = StageResult(outputs=outputs.get(p.stage.name, {}))
            inputs = {u: manifests[u] for u in p.stage.upstream}
            manifests[p.stage.name] = runner.run_stage(cfg, p, lambda ctx, r=result: r, inputs, NullTracker())
    return manifests
