"""Every stage's cache key of every shipped config equals the key recorded in
tests/fixtures/cache_keys.json: how the config is cut into sections, and which section a
setting lives in, never invalidates a cached stage (only the values a stage reads do)."""

import json
from pathlib import Path

import pytest

from pipeline.config import load_config
from pipeline.dag import compute_keys

ROOT = Path(__file__).resolve().parents[3]
RECORDED = json.loads((ROOT / "tests" / "fixtures" / "cache_keys.json").read_text())
CASES = {name: keys for name, keys in RECORDED.items() if not name.startswith("_")}


def _config(name: str):
    """"configs/a.toml + configs/b.toml --section.key=value ..." -> the loaded Config."""
    words = name.split()
    paths = [ROOT / w for w in words if w.endswith(".toml")]
    return load_config(paths, [w for w in words if w.startswith("--")])


def test_every_shipped_config_is_recorded():
    shipped = {str(p.relative_to(ROOT)) for p in [*(ROOT / "configs").glob("*.toml"),
                                                  *(ROOT / "configs" / "peer").glob("*.toml")]}
    rows = {f"configs/base.toml + {p.relative_to(ROOT)}" for p in (ROOT / "configs" / "table3").glob("*.toml")}
    assert shipped | rows <= set(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_cache_keys_are_the_recorded_ones(name, monkeypatch):
    monkeypatch.chdir(ROOT)  # a relative data.mirror would resolve against the working directory
    assert compute_keys(_config(name)) == CASES[name]


def test_a_mirror_keys_the_wmt14_download_only(monkeypatch):
    """A Multi30k file is checked against its pinned sha256 wherever it comes from; a WMT14 mirror's
    archives are checked against the mirror's own SHA256SUMS (the offline stand-in holds samples)."""
    monkeypatch.chdir(ROOT)
    for name, keyed in (("configs/multi30k-tiny.toml", False), ("configs/local.toml", True)):
        plain, mirrored = (compute_keys(load_config(name, o)) for o in ([], ["--data.mirror=/a/mirror"]))
        assert (plain["download"] != mirrored["download"]) is keyed, name
        assert (plain["average"] != mirrored["average"]) is keyed, name  # and so every stage after it


@pytest.mark.parametrize("name", sorted(RECORDED["_former"]))
def test_the_former_rule_gives_the_keys_recorded_under_it(name, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert compute_keys(_config(name), former={"download"}) == RECORDED["_former"][name]


def test_a_work_dir_made_under_the_former_rule_is_used_as_it_is(tmp_path, monkeypatch):
    """A Multi30k work dir whose stages finished at the keys recorded before download stopped keying
    data.mirror: the plan finds each stage cached at its old key (nothing moved or rerun), the
    model is found there, and a fresh work dir gets the new keys."""
    from pipeline.dag import ORDER, STAGES, stage_dir
    from pipeline.models import find_model
    from pipeline.stage import NullTracker, StageResult
    from workflows import runner

    monkeypatch.chdir(ROOT)
    name = "configs/multi30k-tiny.toml"
    old, new = RECORDED["_former"][name], CASES[name]
    cfg = load_config(name, [f"--run.work_dir={tmp_path / 'old'}"])
    outputs = {"vocab": {"model": "/old/spm.model"},
               "average": {"model": "/old/avg/model.pt", "model_config": {"vocab_size": 100}}}
    done: dict = {}
    for stage in STAGES[: ORDER.index("average") + 1]:  # the runner writes each at its former key
        p = runner.StagePlan(stage=stage, key=old[stage.name], out_dir=stage_dir(cfg, stage.name, old[stage.name]),
                             action="run", reason="before")
        result = StageResult(outputs=outputs.get(stage.name, {}))
        done[stage.name] = runner.run_stage(cfg, p, lambda ctx, r=result: r, {u: done[u] for u in stage.upstream},
                                            NullTracker())
    plans = {p.stage.name: p for p in runner.make_plan(cfg, to="average")}
    assert {n: (p.key, p.action) for n, p in plans.items() if n in done} == {n: (old[n], "cached") for n in done}
    files = find_model(config=[name], work_dir=str(tmp_path / "old"))
    assert (files.model, files.spm) == ("/old/avg/model.pt", "/old/spm.model")
    fresh = runner.make_plan(load_config(name, [f"--run.work_dir={tmp_path / 'new'}"]))
    assert {p.stage.name: p.key for p in fresh} == new


def test_every_earlier_rule_names_a_stage_and_keys_that_exist():
    """pipeline/config/migrations.py's table: each stage is the DAG's, each key a config key its
    stage no longer reads (else the rule would change nothing)."""
    from pipeline.config.migrations import FORMERLY_READS
    from pipeline.dag import BY_NAME

    cfg = load_config(None, ["--data.source=multi30k"])  # a source whose download no longer keys the mirror
    for stage, keys in FORMERLY_READS.items():
        assert BY_NAME[stage].formerly_reads == keys
        for key in keys:
            section, name = key.split(".")
            assert hasattr(getattr(cfg, section), name), key
            assert key not in BY_NAME[stage].key_material(cfg), (stage, key)
            assert key in BY_NAME[stage].key_material(cfg, former=True), (stage, key)
