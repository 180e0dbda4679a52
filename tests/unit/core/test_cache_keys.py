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
