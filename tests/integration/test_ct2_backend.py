"""``decode.backend = "ctranslate2"``: translate runs the exported CTranslate2 model in the same Ray
Data actors, hypotheses in source order, empty and over-long lines handled as with our beam search.

Greedy decoding (beam 1, alpha 0) is the same search in both engines, so the two backends must
write identical hypothesis files for the tiny trained model (tests/conftest.py), on held-out
sentences of its toy language.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.config import Config
from pipeline.evaluate import translate
from pipeline.stage import Manifest, StageContext

# The bound on each test (pytest-timeout): the session's tiny model may be trained here first.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

NUM_LINES = 30


@pytest.fixture(scope="module")
def split_dir(tiny_model, tmp_path_factory) -> Path:
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=tiny_model["spm"])
    en = tiny_model["test_en"][:NUM_LINES]
    en[4] = ""  # an empty source gives an empty line
    en[11] = " ".join(tiny_model["test_en"][NUM_LINES:])  # over max_source_len (max_positions 256): truncated
    assert len(sp.encode(en[11])) > tiny_model["model_config"]["max_positions"]
    out = tmp_path_factory.mktemp("ct2_split")
    for shard, rows in enumerate([range(1, NUM_LINES, 2), range(0, NUM_LINES, 2)]):  # interleaved shards
        rows = list(rows)
        pq.write_table(pa.table({"idx": pa.array(rows, pa.int64()),
                                 "src_ids": pa.array([sp.encode(en[i]) for i in rows], pa.list_(pa.int32()))}),
                       out / f"part-{shard:05d}.parquet")
    return out


def _ctx(tiny_model, tiny_export, split_dir, tmp_path, backend: str) -> StageContext:
    cfg = Config()
    cfg.decode.backend = backend
    cfg.decode.ct2_quantization = "float32"
    cfg.decode.beam_size, cfg.decode.alpha = 1, 0.0  # greedy: the same search in both engines
    cfg.decode.use_gpu = False
    cfg.decode.batch_tokens = 300  # several batches
    cfg.run.data_num_cpus = 1.0
    inputs = {
        "average": Manifest(stage="average", key="a", dir=tiny_model["model_dir"], outputs={
            "model": tiny_model["model"], "model_config": tiny_model["model_config"]}),
        "encode": Manifest(stage="encode", key="e", dir="", outputs={"splits": {"test": {"dir": str(split_dir)}}}),
        "vocab": Manifest(stage="vocab", key="v", dir="", outputs={"model": tiny_model["spm"]}),
        "export": Manifest(stage="export", key="x", dir="", outputs=dict(tiny_export)),
    }
    out = tmp_path / backend
    out.mkdir()
    return StageContext(name="translate", key="t", cfg=cfg, out_dir=str(out), inputs=inputs)


def test_ctranslate2_backend_writes_our_greedy_hypotheses_in_source_order(
        tiny_model, tiny_export, split_dir, tmp_path, ray_local):
    hyps, splits = {}, {}
    for backend in ("torch", "ctranslate2"):
        res = translate.run(_ctx(tiny_model, tiny_export, split_dir, tmp_path, backend))
        splits[backend] = res.outputs["splits"]["test"]
        assert res.outputs["decode"]["backend"] == backend
        hyps[backend] = Path(splits[backend]["hyps"]).read_text(encoding="utf-8").split("\n")[:-1]
    for s in splits.values():
        assert (s["num_sentences"], s["num_empty"], s["num_truncated"], s["num_failed"]) == (NUM_LINES, 1, 1, 0)
    assert len(hyps["ctranslate2"]) == NUM_LINES and hyps["ctranslate2"][4] == ""
    assert len(set(hyps["torch"])) > NUM_LINES // 2  # differ by source: an order shift would show
    assert hyps["ctranslate2"] == hyps["torch"]
