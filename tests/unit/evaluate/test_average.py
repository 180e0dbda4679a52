"""The average stage: the file it writes is the element-wise mean of the checkpoints it names."""

from __future__ import annotations

import json

import pytest
import torch

from model import ModelConfig, Transformer
from pipeline.evaluate import average
from pipeline.config import Config
from pipeline.stage import Manifest, StageContext

TINY = ModelConfig(vocab_size=40, d_model=16, d_ff=32, n_heads=2, n_encoder_layers=1, n_decoder_layers=1,
                   max_positions=32)


def _checkpoints(root, num: int) -> list[str]:
    """num checkpoint folders (model.pt + meta.json) of differently initialised tiny models."""
    uris = []
    for i in range(num):
        torch.manual_seed(i)
        d = root / f"checkpoint_{i:06d}"
        d.mkdir(parents=True)
        torch.save(Transformer(TINY).state_dict(), d / "model.pt")
        (d / "meta.json").write_text(json.dumps({"step": 100 * (i + 1), "model_config": TINY.to_dict()}))
        uris.append(str(d))
    return uris


def _ctx(tmp_path, checkpoints: list[str], average_last: int) -> StageContext:
    cfg = Config()
    cfg.average.checkpoints = average_last
    train = Manifest(stage="train", key="t", dir=str(tmp_path / "train"),
                     outputs={"checkpoints": checkpoints, "final_step": 100 * len(checkpoints),
                              "model_config": TINY.to_dict()})
    out = tmp_path / "average"
    out.mkdir(exist_ok=True)
    return StageContext(name="average", key="a", cfg=cfg, out_dir=str(out), inputs={"train": train})


def _load(path):
    return torch.load(path, weights_only=True, map_location="cpu")


def test_average_is_the_elementwise_mean_of_the_last_n(tmp_path):
    ckpts = _checkpoints(tmp_path / "train", 4)
    result = average.run(_ctx(tmp_path, ckpts, average_last=3))

    assert result.outputs["averaged"] == ckpts[1:]
    assert result.outputs["steps"] == [200, 300, 400]
    assert result.outputs["model_config"] == TINY.to_dict()
    got = _load(result.outputs["model"])
    inputs = [_load(f"{c}/model.pt") for c in ckpts[1:]]
    assert set(got) == set(inputs[0])
    for key, tensor in got.items():
        expected = torch.stack([sd[key].double() for sd in inputs]).mean(dim=0)  # independent mean
        assert tensor.dtype == inputs[0][key].dtype
        torch.testing.assert_close(tensor.double(), expected, rtol=0, atol=1e-7)
    assert not torch.equal(got["src_embed.weight"], inputs[-1]["src_embed.weight"])

    out = tmp_path / "average"
    assert json.loads((out / "averaged.json").read_text())["checkpoints"] == ckpts[1:]
    assert json.loads((out / "model_config.json").read_text()) == TINY.to_dict()
    Transformer(TINY).load_state_dict(got)  # a complete, loadable state dict


def test_average_last_one_is_the_last_checkpoint(tmp_path):
    ckpts = _checkpoints(tmp_path / "train", 2)
    got = _load(average.run(_ctx(tmp_path, ckpts, average_last=1)).outputs["model"])
    last = _load(f"{ckpts[-1]}/model.pt")
    for key in last:
        assert torch.equal(got[key], last[key]), key


def test_too_few_checkpoints_is_an_error_naming_the_numbers(tmp_path):
    ckpts = _checkpoints(tmp_path / "train", 2)
    with pytest.raises(ValueError, match=r"average\.checkpoints = 5 but train kept only 2 .*--average.checkpoints=2"):
        average.run(_ctx(tmp_path, ckpts, average_last=5))
