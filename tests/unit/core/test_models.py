"""``pipeline.models.find_model``: a config's model is its DAG plan's outputs, never the newest folder.

The work dirs are written by the real runner (tests/support/fake_run.py: every stage of the
closure finished, with outputs we choose), then looked up by config, by explicit paths, and in
the ways that must fail with the stage or file named.
"""

from __future__ import annotations

import json

import pytest

from pipeline.config import load_config
from pipeline.models import ModelNotFound, find_model
from tests.support.fake_run import fake_run

LOCAL = "configs/local.toml"
MODEL_CONFIG = {"vocab_size": 100, "d_model": 16}


def _outputs(tag: str) -> dict:
    return {"vocab": {"model": f"/spm-{tag}.model"},
            "average": {"model": f"/avg-{tag}/model.pt", "model_config": {**MODEL_CONFIG, "tag": tag}},
            "export": {"hf": f"/exp-{tag}/hf", "ct2_float32": f"/exp-{tag}/ct2-float32",
                       "ct2_int8": f"/exp-{tag}/ct2-int8"}}


def _cfg(work_dir, *overrides):
    return load_config(LOCAL, [f"--run.work_dir={work_dir}", *overrides])


def test_each_config_gets_its_own_model_in_a_shared_work_dir(tmp_path):
    fake_run(_cfg(tmp_path), _outputs("small"), to="export")
    fake_run(_cfg(tmp_path, "--model.d_ff=96"), _outputs("wide"), to="export")  # ran last: newest files
    small = find_model(config=[LOCAL], work_dir=str(tmp_path))
    wide = find_model(config=[LOCAL], overrides=["--model.d_ff=96"], work_dir=str(tmp_path))
    assert (small.model, small.spm, small.model_config["tag"]) == ("/avg-small/model.pt", "/spm-small.model", "small")
    assert (wide.model, wide.ct2_model("int8"), wide.hf) == ("/avg-wide/model.pt", "/exp-wide/ct2-int8", "/exp-wide/hf")
    assert small.ct2_model("float32") == "/exp-small/ct2-float32"


def test_an_unfinished_stage_is_named(tmp_path):
    fake_run(_cfg(tmp_path), _outputs("x"), to="train")
    with pytest.raises(ModelNotFound, match="stage 'average' has not finished for this config"):
        find_model(config=[LOCAL], work_dir=str(tmp_path))


def test_without_export_the_torch_model_is_found_and_ctranslate2_says_why_not(tmp_path):
    fake_run(_cfg(tmp_path), _outputs("x"), to="average")
    files = find_model(config=[LOCAL], work_dir=str(tmp_path))
    assert files.model == "/avg-x/model.pt"
    with pytest.raises(ModelNotFound, match="stage 'export' has not finished"):
        files.ct2_model("int8")


def test_a_stage_rerun_upstream_makes_the_model_stale(tmp_path):
    cfg = _cfg(tmp_path)
    fake_run(cfg, _outputs("x"), to="average")
    fake_run(cfg, {**_outputs("x"), "train": {"final_step": 2}}, to="train", force=("train",))  # average not rerun
    with pytest.raises(ModelNotFound, match="stage 'average' .* is stale: upstream train was rerun"):
        find_model(config=[LOCAL], work_dir=str(tmp_path))


def test_the_text_format_comes_with_the_model_found(tmp_path):
    """A config's data.preprocess and languages (config lookup), the average manifest's resolved
    config (an explicit average dir), nothing where neither is known (a bare folder)."""
    fake_run(_cfg(tmp_path, "--data.preprocess=lowercase_moses"), _outputs("x"), to="average")
    files = find_model(config=[LOCAL], overrides=["--data.preprocess=lowercase_moses"], work_dir=str(tmp_path))
    assert files.text == {"preprocess": "lowercase_moses", "src_lang": "en", "tgt_lang": "de"}
    (avg_dir,) = (tmp_path / "average").glob("*/")
    (avg_dir / "model_config.json").write_text(json.dumps(MODEL_CONFIG))
    assert find_model(model_dir=str(avg_dir), spm="/s.model").text == files.text
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "model_config.json").write_text(json.dumps(MODEL_CONFIG))
    assert find_model(model_dir=str(bare), spm="/s.model").text == {}


def test_explicit_paths_and_the_ways_to_get_it_wrong(tmp_path):
    (tmp_path / "model_config.json").write_text(json.dumps(MODEL_CONFIG))
    files = find_model(model_dir=str(tmp_path), spm="/s.model", ct2_model="/ct2")
    assert (files.model, files.spm, files.ct2_model("int8")) == (str(tmp_path / "model.pt"), "/s.model", "/ct2")
    with pytest.raises(ModelNotFound, match="neither model_config.json"):
        find_model(model_dir=str(tmp_path / "nothing"), spm="/s.model")
    with pytest.raises(ModelNotFound, match="give spm="):
        find_model(model_dir=str(tmp_path))
    with pytest.raises(ModelNotFound, match="work_dir alone names no model"):
        find_model(work_dir=str(tmp_path))
    with pytest.raises(ModelNotFound, match="got config, model"):
        find_model(config=[LOCAL], model_uri="models:/m/1")
    with pytest.raises(ModelNotFound, match="expected models:/<name>/<version>"):
        find_model(model_uri="runs:/abc/model", tracking_uri=f"sqlite:///{tmp_path / 'm.db'}")
