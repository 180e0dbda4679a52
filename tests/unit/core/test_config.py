"""The typed config tree: shipped files load, bad keys/types/values are errors naming the key."""

from pathlib import Path

import pytest

from pipeline.config import Config, ConfigError, from_dict, load_config

CONFIGS = sorted((Path(__file__).resolve().parents[3] / "configs").glob("*.toml"))


def test_configs_folder_is_not_empty():
    assert {p.name for p in CONFIGS} >= {"base.toml", "local.toml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    cfg = load_config(path)
    assert isinstance(cfg, Config)
    assert from_dict(cfg.to_dict()) == cfg  # round trip, e.g. into Ray workers


def test_defaults_are_the_papers_recipe():
    cfg = Config()
    assert (cfg.model.d_model, cfg.model.d_ff, cfg.model.n_heads) == (512, 2048, 8)
    assert (cfg.model.n_encoder_layers, cfg.model.n_decoder_layers, cfg.model.dropout) == (6, 6, 0.1)
    assert (cfg.train.adam_beta1, cfg.train.adam_beta2, cfg.train.adam_eps) == (0.9, 0.98, 1e-9)
    assert (cfg.train.warmup_steps, cfg.train.max_steps, cfg.train.tokens_per_step) == (4000, 100_000, 25000)
    assert cfg.train.label_smoothing == 0.1 and cfg.vocab.size == 37000
    assert (cfg.eval.beam_size, cfg.eval.alpha, cfg.eval.max_len_b, cfg.eval.average_last) == (4, 0.6, 50, 5)


def test_override_beats_file_beats_default(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("[train]\nmax_steps = 10\nwarmup_steps = 7\n")
    cfg = load_config(f, ["--train.max_steps=20", "--eval.splits=test,dev", "--train.use_gpu=false"])
    assert cfg.train.max_steps == 20 and cfg.train.warmup_steps == 7 and cfg.train.log_interval_steps == 100
    assert cfg.eval.splits == ["test", "dev"] and cfg.train.use_gpu is False


@pytest.mark.parametrize("text, key", [
    ("[train]\nmax_stepz = 1\n", "train.max_stepz"),
    ("[trian]\nmax_steps = 1\n", "trian"),
    ("[train]\nmax_steps = 'ten'\n", "train.max_steps"),
    ("[train]\nmax_steps = 1.5\n", "train.max_steps"),
    ("[train]\nuse_gpu = 1\n", "train.use_gpu"),
    ("[model]\nd_model = 100\nn_heads = 8\n", "model.d_model"),
    ("[train]\nprecision = 'fp8'\n", "train.precision"),
    ("[eval]\nsplits = ['valid']\n", "eval.splits"),
    ("[eval]\naverage_last = 9\n", "train.keep_checkpoints"),
    ("[data]\nsource = 'custom'\n", "data.train_src"),
])
def test_bad_files_name_the_key(tmp_path, text, key):
    f = tmp_path / "bad.toml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(f)


def test_bad_overrides_name_the_key():
    with pytest.raises(ConfigError, match=r"train\.max_steps"):
        load_config(None, ["--train.max_steps=abc"])
    with pytest.raises(ConfigError, match="section.key=value"):
        load_config(None, ["--max_steps=3"])
    with pytest.raises(ConfigError, match="no such file"):
        load_config("nope.toml")


def test_operational_fields_are_not_cache_material():
    cfg = Config()
    assert "num_workers" not in cfg.section_for_cache("train")
    assert "max_steps" in cfg.section_for_cache("train")


def test_a_local_mirror_has_one_spelling(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m").mkdir()
    a = load_config(None, ["--data.mirror=./m"])
    b = load_config(None, [f"--data.mirror={tmp_path}/x/../m"])
    assert a.data.mirror == b.data.mirror == str(tmp_path / "m")
    assert load_config(None, ["--data.mirror=http://host/wmt"]).data.mirror == "http://host/wmt"
