"""The options after 2017 as ``[model]`` keys: checked by name, in a stage's cache key only when set
(so every key recorded in tests/fixtures/cache_keys.json holds), and in the key reference."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.config import ConfigError, load_config
from pipeline.dag import compute_keys

ROOT = Path(__file__).resolve().parents[3]
OPTIONS = {"norm_position": ("post", "pre"), "norm": ("layernorm", "rmsnorm"), "ffn": ("relu", "swiglu")}
MODEL_STAGES = {"train", "average", "export", "translate", "score", "register"}


@pytest.mark.parametrize("key", sorted(OPTIONS))
def test_an_option_is_keyed_only_when_set(key, monkeypatch):
    monkeypatch.chdir(ROOT)
    paper, later = OPTIONS[key]
    plain = compute_keys(load_config("configs/multi30k-tiny.toml"))
    assert compute_keys(load_config("configs/multi30k-tiny.toml", [f"--model.{key}={paper}"])) == plain
    changed = compute_keys(load_config("configs/multi30k-tiny.toml", [f"--model.{key}={later}"]))
    assert {stage for stage in plain if changed[stage] != plain[stage]} == MODEL_STAGES


def test_rotary_is_a_value_of_positional_and_a_wrong_value_is_named():
    cfg = load_config(None, ["--model.positional=rotary", "--model.norm=rmsnorm"])
    assert (cfg.model.positional, cfg.model.norm) == ("rotary", "rmsnorm")
    with pytest.raises(ConfigError, match="model.ffn"):
        load_config(None, ["--model.ffn=geglu"])
    with pytest.raises(ConfigError, match="model.positional = 'rotary' rotates pairs"):
        load_config(None, ["--model.positional=rotary", "--model.d_k=15"])


def test_the_key_reference_lists_them_as_keyed_when_set():
    from pipeline.config.reference import keys

    rows = {k.key: k for k in keys() if k.section == "model"}
    for key in OPTIONS:
        assert rows[key].cache == "when set" and "20" in rows[key].meaning  # a cited paper's year
    assert rows["positional"].cache == "yes" and "rotary" in rows["positional"].type
