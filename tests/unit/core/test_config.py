"""The typed config tree: shipped files load, bad keys/types/values are errors naming the key."""

import json
from pathlib import Path

import pytest

from pipeline.config import Config, ConfigError, from_dict, load_config
from pipeline.dag import ORDER

CONFIG_DIR = Path(__file__).resolve().parents[3] / "configs"
CONFIGS = sorted([*CONFIG_DIR.glob("*.toml"), *CONFIG_DIR.glob("peer/*.toml"), *CONFIG_DIR.glob("table3/*.toml")])


def test_configs_folder_is_not_empty():
    assert {p.name for p in CONFIGS} >= {"base.toml", "local.toml", "big.toml", "enfr-base.toml", "enfr-big.toml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(CONFIG_DIR)))
def test_every_shipped_config_loads_and_plans(path, tmp_path):
    from workflows.runner import make_plan

    cfg = load_config(path)
    assert isinstance(cfg, Config)
    assert from_dict(cfg.to_dict()) == cfg  # round trip, e.g. into Ray workers
    cfg.run.work_dir, cfg.run.storage_path = str(tmp_path), ""  # plan against an empty local work dir
    assert [p.action for p in make_plan(cfg)] == ["run"] * len(ORDER)
    # The device is found, not configured (DESIGN.md): a GPU when Ray sees one, the CPUs otherwise;
    # the paper's rows only demand that there is one (they are GPU recipes: refused on CPUs, billed for GPUs).
    gpu_recipe = path.parent == CONFIG_DIR and path.name in {"base.toml", "big.toml", "enfr-base.toml", "enfr-big.toml",
                                                             "cluster.toml"}
    assert (cfg.workers.use_gpu, cfg.decode.use_gpu) == (True if gpu_recipe else "auto", "auto")
    assert cfg.speed.compile == cfg.speed.shape_buckets == cfg.speed.fused_loss == "auto"


def test_table2_configs_are_the_papers_rows():
    """§6.1 and Table 3 "big": sizes, dropout, steps, checkpoints averaged, vocabulary per row."""
    big, fr_base, fr_big = (load_config(CONFIG_DIR / f) for f in ("big.toml", "enfr-base.toml", "enfr-big.toml"))
    for cfg in (big, fr_big):
        assert (cfg.model.d_model, cfg.model.d_ff, cfg.model.n_heads) == (1024, 4096, 16)
        assert (cfg.train.max_steps, cfg.checkpoint.interval_s) == (300_000, 600.0)
        assert cfg.average.checkpoints == 20 and cfg.checkpoint.num_to_keep >= 20
    assert big.model.dropout == 0.3 and fr_big.model.dropout == 0.1
    assert (fr_base.model.d_model, fr_base.model.dropout, fr_base.average.checkpoints) == (512, 0.1, 5)
    for cfg in (fr_base, fr_big):
        assert (cfg.data.tgt_lang, cfg.vocab.size) == ("fr", 32000)
        assert cfg.tracking.experiment == "transformer-wmt14-enfr"
    assert (big.data.tgt_lang, big.vocab.size) == ("de", 37000)


def test_later_config_files_override_earlier_ones(tmp_path):
    a, b = tmp_path / "a.toml", tmp_path / "b.toml"
    a.write_text("[train]\nmax_steps = 10\nwarmup_steps = 7\n")
    b.write_text("[train]\nmax_steps = 20\n[run]\nwork_dir = 'elsewhere'\n")
    cfg = load_config([a, b], ["--train.warmup_steps=3"])
    assert (cfg.train.max_steps, cfg.train.warmup_steps, cfg.run.work_dir) == (20, 3, "elsewhere")
    with pytest.raises(ConfigError, match="no such file"):
        load_config([a, tmp_path / "missing.toml"])


def test_defaults_are_the_papers_recipe():
    cfg = Config()
    assert (cfg.model.d_model, cfg.model.d_ff, cfg.model.n_heads) == (512, 2048, 8)
    assert (cfg.model.n_encoder_layers, cfg.model.n_decoder_layers, cfg.model.dropout) == (6, 6, 0.1)
    assert (cfg.train.adam_beta1, cfg.train.adam_beta2, cfg.train.adam_eps) == (0.9, 0.98, 1e-9)
    assert (cfg.train.warmup_steps, cfg.train.max_steps, cfg.train.tokens_per_step) == (4000, 100_000, 25000)
    assert cfg.train.label_smoothing == 0.1 and cfg.vocab.size == 37000
    assert (cfg.decode.beam_size, cfg.decode.alpha, cfg.decode.max_len_b, cfg.average.checkpoints) == (4, 0.6, 50, 5)


def test_override_beats_file_beats_default(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("[train]\nmax_steps = 10\nwarmup_steps = 7\n")
    cfg = load_config(f, ["--train.max_steps=20", "--score.splits=test,dev", "--workers.use_gpu=false"])
    assert cfg.train.max_steps == 20 and cfg.train.warmup_steps == 7 and cfg.metrics.log_interval_steps == 100
    assert cfg.score.splits == ["test", "dev"] and cfg.workers.use_gpu is False


@pytest.mark.parametrize("text, key", [
    ("[train]\nmax_stepz = 1\n", "train.max_stepz"),
    ("[trian]\nmax_steps = 1\n", "trian"),
    ("[train]\nmax_steps = 'ten'\n", "train.max_steps"),
    ("[train]\nmax_steps = 1.5\n", "train.max_steps"),
    ("[workers]\nuse_gpu = 1\n", "workers.use_gpu"),
    ("[model]\nd_model = 100\nn_heads = 8\n", "model.d_model"),
    ("[speed]\nprecision = 'fp8'\n", "speed.precision"),
    ("[score]\nsplits = ['valid']\n", "score.splits"),
    ("[average]\ncheckpoints = 9\n", "checkpoint.num_to_keep"),
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


def _literal_fields():
    import dataclasses
    import typing

    for section in dataclasses.fields(Config):
        for name, tp in typing.get_type_hints(typing.get_type_hints(Config)[section.name]).items():
            if typing.get_origin(tp) is typing.Literal:
                yield section.name, name, typing.get_args(tp)


def test_fixed_set_fields_are_literals_checked_from_their_annotations():
    """A bad value of every Literal-typed field, from a file, an override or set by hand, is an
    error naming the key, the value and the allowed values."""
    import re

    found = {f"{s}.{k}" for s, k, _ in _literal_fields()}
    assert found >= {"data.source", "data.preprocess", "vocab.model_type", "model.positional", "speed.precision",
                     "train.early_stop_metric", "decode.backend", "decode.ct2_quantization", "dev_bleu.engine",
                     "dev_bleu.quantization", "average.select", "workers.placement_strategy"}
    for section, key, choices in _literal_fields():
        want = re.escape(f"{section}.{key}: 'bogus' is not allowed (allowed: {', '.join(map(repr, choices))})")
        with pytest.raises(ConfigError, match=want):
            load_config(None, [f"--{section}.{key}=bogus"])
        cfg = Config()
        setattr(getattr(cfg, section), key, "bogus")
        with pytest.raises(ConfigError, match=want):
            cfg.validate()
    with pytest.raises(ConfigError, match=re.escape("score.splits[1]: 'valid' is not allowed (allowed: 'test', 'dev')")):
        load_config(None, ["--score.splits=test,valid"])


def test_model_section_is_model_sizes_and_none_is_keyed_as_zero():
    import dataclasses

    from model import ModelConfig, ModelSizes
    from pipeline.config import ModelSection
    from pipeline.models import model_config_for

    assert [f.name for f in dataclasses.fields(ModelSection)] == [f.name for f in dataclasses.fields(ModelSizes)]
    cfg = load_config(None, ["--model.d_k=16"])
    assert (cfg.model.d_k, cfg.model.d_v) == (16, None)
    assert cfg.section_for_cache("model")["d_v"] == 0  # "unset" as keyed before d_k/d_v took None
    assert load_config(None, ["--model.d_k=16", "--model.d_k=none"]).model.d_k is None
    assert "d_v" not in cfg.to_dict()["model"] and from_dict(cfg.to_dict()) == cfg  # TOML has no None
    with pytest.raises(ConfigError, match=r"model\.d_k must be positive, got 0"):
        load_config(None, ["--model.d_k=0"])
    mc = model_config_for(cfg, {"vocab_size": 100, "pad_id": 1, "bos_id": 5, "eos_id": 7})
    assert mc == ModelConfig(vocab_size=100, pad_id=1, bos_id=5, eos_id=7, d_k=16)


@pytest.mark.parametrize("text, message", [
    ('[train]\nprecision = "bf16"\n', "train.precision is now speed.precision"),
    ("[train]\nnum_workers = 2\n", "train.num_workers is now workers.num_workers"),
    ("[train]\nkeep_checkpoints = 5\n", "train.keep_checkpoints is now checkpoint.num_to_keep"),
    ("[train]\neval_interval_steps = 10\n", "train.eval_interval_steps is now metrics.val_loss_interval_steps"),
    ('[train]\ngpu_type = "H100"\n', "train.gpu_type is now plan.gpu_type"),
])
def test_an_old_key_in_a_file_names_its_new_key(tmp_path, text, message):
    f = tmp_path / "old.toml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        load_config(f)


def test_every_moved_key_is_refused_from_files_and_overrides(tmp_path):
    """Nothing is ignored: each old spelling is an error naming the new key, which exists."""
    from pipeline.config import MOVED_KEYS

    defaults = Config().to_dict()
    assert len(MOVED_KEYS) == 49
    for old, new in MOVED_KEYS.items():
        old_section, old_key = old.split(".")
        section, key = new.split(".")
        assert key in defaults[section], new
        assert old_key not in defaults.get(old_section, {}), old
        value = defaults[section][key]
        text = value if not isinstance(value, list) else ",".join(map(str, value))
        want = f"{old} is now {new}".replace(".", r"\.")
        with pytest.raises(ConfigError, match=want):
            load_config(None, [f"--{old}={text}"])
        f = tmp_path / "old.toml"
        f.write_text(f"[{old_section}]\n{old_key} = {json.dumps(value)}\n")
        with pytest.raises(ConfigError, match=want):
            load_config(f)
        assert getattr(getattr(load_config(None, [f"--{new}={text}"]), section), key) == value


def test_a_saved_config_dict_reads_its_moved_keys_in_their_new_places():
    """A run record written before the keys moved (`make serve` reads its config) still loads."""
    cfg = from_dict({"eval": {"beam_size": 7, "average_last": 2, "splits": ["dev"], "dev_bleu": False,
                              "dev_bleu_resources": "CPU=3"},
                     "train": {"precision": "fp32", "max_steps": 9}, "checkpoint": {"num_to_keep": 2}})
    assert (cfg.decode.beam_size, cfg.average.checkpoints, cfg.score.splits) == (7, 2, ["dev"])
    assert (cfg.dev_bleu.enabled, cfg.dev_bleu.resources) == (False, "CPU=3")
    assert (cfg.speed.precision, cfg.train.max_steps) == ("fp32", 9)


def test_only_train_and_model_make_the_train_key():
    """The sections beside [train] are operational: none of their fields is cache material."""
    cfg = Config()
    for section in ("speed", "workers", "checkpoint", "metrics", "plan", "run", "tracking"):
        assert cfg.section_for_cache(section) == {}, section
    assert set(cfg.section_for_cache("train")) == {
        "tokens_per_step", "max_steps", "warmup_steps", "lr_scale", "label_smoothing", "adam_beta1", "adam_beta2",
        "adam_eps", "clip_norm", "max_len", "seed"}
