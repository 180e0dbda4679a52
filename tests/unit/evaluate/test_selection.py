"""Checkpoint selection for `average` (last / best dev BLEU) and the plan-time refusal of a config
whose training cannot leave the checkpoints averaging needs."""

from __future__ import annotations

import json

import pytest
import torch

from model import Transformer
from pipeline.config import Config, ConfigError, DecodeSettings, load_config
from pipeline.decoding import dev_bleu, dev_bleu_records
from pipeline.decoding.selection import plan_check, select_best, step_checkpoints
from pipeline.evaluate import average
from pipeline.train import dev_bleu_validation as train_dev_bleu
from pipeline.stage import Manifest, StageContext
from tests.unit.evaluate.test_average import TINY, _checkpoints, _load
from workflows import reproduce_base
from workflows.runner import compute_keys


def test_best_picks_the_highest_scores_in_step_order():
    ckpts = ["c100", "c200", "c300", "c400", "c500"]
    scores = {"c100": 10.0, "c200": 30.0, "c300": 20.0, "c400": 30.0, "c500": 5.0}
    assert select_best(ckpts, scores, 2) == ["c200", "c400"]
    assert select_best(ckpts, scores, 3) == ["c200", "c300", "c400"]
    assert select_best(ckpts[:3], {"c100": 1.0, "c200": 2.0, "c300": 2.0}, 1) == ["c300"]  # a tie: the later step
    with pytest.raises(ValueError, match="no dev BLEU for c500"):
        select_best(ckpts, {k: v for k, v in scores.items() if k != "c500"}, 2)
    with pytest.raises(ValueError, match="train kept only 2"):
        select_best(ckpts[:2], scores, 3)


def _history(tmp_path, bleus: list[float], settings: dict) -> tuple[list[str], str]:
    """Checkpoints in a Ray Train-like run dir and the dev BLEU records a training run left."""
    run_dir = tmp_path / "ray_train" / "run"
    ckpts = _checkpoints(run_dir, len(bleus))
    for uri, b in zip(ckpts, bleus):
        name = uri.rsplit("/", 1)[-1]
        step = json.loads((tmp_path / uri / "meta.json").read_text())["step"]
        dev_bleu_records.write_record(str(run_dir), {"checkpoint": name, "step": step, "status": "validated",
                                             "settings": settings, "bleu_sacre": b, "chrf": 2 * b})
    dev_bleu_records.write_record(str(run_dir), {"checkpoint": "checkpoint_gone", "step": 1, "status": "skipped",
                                         "settings": settings})  # rotated away: not a candidate
    return ckpts, str(run_dir)


def _ctx(tmp_path, cfg: Config, ckpts: list[str], run_dir: str) -> StageContext:
    train = Manifest(stage="train", key="t", dir=str(tmp_path / "train"),
                     outputs={"checkpoints": ckpts, "final_step": 100 * len(ckpts), "model_config": TINY.to_dict(),
                      "storage_path": str(tmp_path / "ray_train"), "run_name": "run",
                      "dev_bleu": {"run_dir": run_dir, "dev_dir": "", "spm": ""}})
    (tmp_path / "average").mkdir(exist_ok=True)
    return StageContext(name="average", key="a", cfg=cfg, out_dir=str(tmp_path / "average"), inputs={"train": train})


def test_average_by_best_dev_bleu_on_a_crafted_history(tmp_path):
    cfg = Config()
    cfg.average.checkpoints, cfg.average.select = 2, "best_dev_bleu"
    settings = dev_bleu.DevBleuSettings.from_config(cfg).to_dict()
    ckpts, run_dir = _history(tmp_path, [5.0, 20.0, 10.0, 15.0], settings)

    result = average.run(_ctx(tmp_path, cfg, ckpts, run_dir))

    assert result.outputs["averaged"] == [ckpts[1], ckpts[3]]
    assert result.outputs["steps"] == [200, 400]
    got = _load(result.outputs["model"])
    inputs = [_load(f"{c}/model.pt") for c in (ckpts[1], ckpts[3])]
    for key, tensor in got.items():
        torch.testing.assert_close(tensor.double(), (inputs[0][key].double() + inputs[1][key].double()) / 2,
                                   rtol=0, atol=1e-7)
    Transformer(TINY).load_state_dict(got)
    kept = json.loads((tmp_path / "average" / "averaged.json").read_text())["kept"]
    assert [(k["dev_bleu_sacre"], k["averaged"]) for k in kept] == [(5.0, False), (20.0, True), (10.0, False),
                                                                     (15.0, True)]

    cfg.average.select = "last"  # the paper's rule on the same history
    assert average.run(_ctx(tmp_path, cfg, ckpts, run_dir)).outputs["averaged"] == ckpts[2:]


def test_scores_made_with_other_settings_are_not_used(tmp_path):
    cfg = Config()
    cfg.average.checkpoints, cfg.average.select = 2, "best_dev_bleu"
    other = {**dev_bleu.DevBleuSettings.from_config(cfg).to_dict(), "sentences": 100}
    ckpts, run_dir = _history(tmp_path, [5.0, 20.0, 10.0], other)
    # Not the config's settings: the stage must score them itself, and here it has nothing to score with.
    with pytest.raises(ValueError, match="no dev BLEU with the settings"):
        average.run(_ctx(tmp_path, cfg, ckpts, run_dir))


def test_greedy_ctranslate2_scores_hold_for_any_alpha_ours_do_not(tmp_path):
    """Training validated greedily with CTranslate2 at alpha 1.0; a rerun at alpha 0.6 reuses those
    records (no scoring here: there is nothing to score with). With our own search at beam 1, or
    CTranslate2 at beam 4, alpha can change the output: the records do not hold."""
    cfg = Config()
    cfg.average.checkpoints, cfg.average.select = 2, "best_dev_bleu"
    cfg.dev_bleu.engine, cfg.dev_bleu.beam_size, cfg.decode.alpha = "ctranslate2", 1, 1.0
    made = dev_bleu.DevBleuSettings.from_config(cfg).to_dict()
    ckpts, run_dir = _history(tmp_path, [5.0, 20.0, 10.0], made)
    cfg.decode.alpha = 0.6
    assert average.run(_ctx(tmp_path, cfg, ckpts, run_dir)).outputs["averaged"] == [ckpts[1], ckpts[2]]

    for engine, beam in (("torch", 1), ("ctranslate2", 4)):
        cfg.dev_bleu.engine, cfg.dev_bleu.beam_size, cfg.decode.alpha = engine, beam, 1.0
        made = dev_bleu.DevBleuSettings.from_config(cfg).to_dict()
        ckpts, run_dir = _history(tmp_path / f"{engine}{beam}", [5.0, 20.0, 10.0], made)
        cfg.decode.alpha = 0.6
        with pytest.raises(ValueError, match="no dev BLEU with the settings"):
            average.run(_ctx(tmp_path / f"{engine}{beam}", cfg, ckpts, run_dir))


def test_plan_refuses_a_run_that_cannot_make_the_averaged_checkpoints(tmp_path, capsys):
    args = ["--config", "configs/local.toml", f"--run.work_dir={tmp_path}", "--train.max_steps=400",
            "--checkpoint.interval_steps=100", "--average.checkpoints=5", "--checkpoint.num_to_keep=5", "--plan"]
    assert reproduce_base.main(args) == 2
    err = capsys.readouterr().err
    for key in ("train.max_steps = 400", "checkpoint.interval_steps = 100", "writes 4 checkpoint(s)",
                "average.checkpoints = 5"):
        assert key in err, err
    assert reproduce_base.main(args[:-1] + ["--average.checkpoints=4", "--plan"]) == 0
    capsys.readouterr()
    assert reproduce_base.main([*args[:-1], "--to", "train", "--plan"]) == 0  # no average in this run


def test_time_based_checkpoints_are_announced_not_refused():
    cfg = load_config("configs/big.toml")  # §6.1: checkpoints every 10 minutes, the last 20 averaged
    note = plan_check(cfg)
    assert "expects 1 step checkpoint(s)" in note and "average.checkpoints = 20" in note
    assert step_checkpoints(400, 100) == 4 and step_checkpoints(401, 100) == 5


def test_dev_bleu_settings_key_average_only_when_it_selects_by_them():
    base = compute_keys(load_config("configs/local.toml"))
    changed = compute_keys(load_config("configs/local.toml", ["--dev_bleu.sentences=50",
                                                              "--dev_bleu.resources=CPU=2",
                                                              "--dev_bleu.enabled=false"]))
    assert changed == base  # operational for train, not read by "last"
    best = compute_keys(load_config("configs/local.toml", ["--average.select=best_dev_bleu"]))
    best50 = compute_keys(load_config("configs/local.toml", ["--average.select=best_dev_bleu",
                                                             "--dev_bleu.sentences=50"]))
    assert best["train"] == base["train"] and best["average"] != base["average"] != best50["average"]


def test_bad_dev_bleu_keys_are_named():
    with pytest.raises(ConfigError, match="dev_bleu.resources"):
        load_config(None, ["--dev_bleu.resources=GPU"])
    with pytest.raises(ConfigError, match="average.select"):
        load_config(None, ["--average.select=best"])
    assert train_dev_bleu.task_resources(load_config(None, ["--dev_bleu.resources=GPU=1,CPU=2"]))[1:] == ("cuda", 2)


def test_dev_bleu_settings_hold_decode_settings_and_record_them_flat():
    cfg = load_config(None, ["--decode.beam_size=5", "--dev_bleu.beam_size=1", "--decode.alpha=0.7",
                             "--dev_bleu.sentences=300"])
    s = dev_bleu.DevBleuSettings.from_config(cfg)
    assert s.decode == DecodeSettings(1, 0.7, cfg.decode.max_len_a, cfg.decode.max_len_b)  # dev_bleu_beam_size wins
    # the records' (and average's) form, as before DecodeSettings was held: flat, in this order
    assert list(s.to_dict()) == ["sentences", "engine", "quantization", "beam_size", "alpha", "max_len_a", "max_len_b"]
    assert s.to_dict()["sentences"] == 300 and s.to_dict()["beam_size"] == 1
    assert dev_bleu.DevBleuSettings.from_dict(s.to_dict()) == s
    assert dev_bleu.DevBleuSettings.from_config(load_config(None, ["--decode.beam_size=3"])).decode.beam_size == 3
