"""The translate stage on Ray Data: 1 and 2 workers agree, order and bad input are handled; the CLI.

The session's tiny model (tests/conftest.py: trained on the tests' toy language, no data files) on
held-out sentences of that language: its hypotheses differ by source, which is what the ordering
and worker-count checks need.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from model import ModelConfig
from model import max_source_len
from pipeline.decoding.batching import plan_split, read_split
from pipeline.decoding.translator import Translator
from pipeline.evaluate import score, translate
from pipeline.config import Config
from pipeline.stage import Manifest, StageContext

# The bound on each test (pytest-timeout): Ray Data actors; the tiny model may be trained here first.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]
NUM_LINES = 40
MAX_POSITIONS = 256
MAX_LEN_B = 4  # max source length = (256 - 1 - 4) / 1 = 251 pieces incl. eos


@pytest.fixture(scope="module")
def assets(tiny_model, tmp_path_factory):
    """spm.model, an average-style model dir, and an encoded 'test' split with bad lines."""
    import sentencepiece as spm

    from tests.support.tiny_model import TOY_TEST_SEED, toy_pairs

    root = tmp_path_factory.mktemp("translate")
    sp = spm.SentencePieceProcessor(model_file=tiny_model["spm"])
    cfg = ModelConfig.from_dict(tiny_model["model_config"])
    assert cfg.max_positions == MAX_POSITIONS
    model_dir = Path(tiny_model["model_dir"])

    test_en, test_de = toy_pairs(2 * NUM_LINES, TOY_TEST_SEED)
    src = test_en[:NUM_LINES]
    src[3] = ""  # empty source lines stay empty
    src[17] = ""
    src[9] = " ".join(test_en[NUM_LINES:])  # far longer than 251 pieces: truncated
    ids = [sp.encode(s) for s in src]
    split_dir = root / "encode" / "test"
    split_dir.mkdir(parents=True)
    for shard, rows in enumerate([range(1, NUM_LINES, 2), range(0, NUM_LINES, 2)]):  # interleaved shards
        rows = list(rows)
        pq.write_table(pa.table({
            "idx": pa.array(rows, pa.int64()),
            "src_ids": pa.array([ids[i] for i in rows], pa.list_(pa.int32())),
            "tgt_ids": pa.array([sp.encode(test_de[i]) for i in rows], pa.list_(pa.int32())),
            "src_len": pa.array([len(ids[i]) for i in rows], pa.int32()),
            "tgt_len": pa.array([len(sp.encode(test_de[i])) for i in rows], pa.int32()),
            "src": [src[i] for i in rows], "tgt": [test_de[i] for i in rows]}),
            split_dir / f"part-{shard:05d}.parquet")
    return {"root": root, "spm": tiny_model["spm"], "model_dir": model_dir, "split_dir": split_dir,
            "src": src, "ids": ids, "cfg": cfg}


def _ctx(assets, tmp_path, num_workers: int) -> StageContext:
    cfg = Config()
    cfg.decode.num_workers = num_workers
    cfg.decode.use_gpu = False
    cfg.score.attention_sentences = 0  # no vocab stage in this ctx; the heatmaps are tested in test_multi30k_dag.py
    cfg.decode.beam_size = 2
    cfg.decode.max_len_b = MAX_LEN_B
    cfg.decode.batch_tokens = 400  # several batches per worker
    cfg.decode.threads_per_worker = 1  # as the reference below: the same kernels, the same numbers
    cfg.run.data_num_cpus = 0.5  # 2 actors must not take all of the test Ray's 2 CPUs (ray#44687)
    out = tmp_path / f"translate-{num_workers}"
    out.mkdir()
    inputs = {
        "average": Manifest(stage="average", key="a", dir=str(assets["model_dir"]), outputs={
            "model": str(assets["model_dir"] / "model.pt"), "model_config": assets["cfg"].to_dict(),
            "averaged": ["c1", "c2"], "steps": [10, 20]}),
        "encode": Manifest(stage="encode", key="e", dir="", outputs={
            "splits": {"test": {"dir": str(assets["split_dir"]), "num_rows": NUM_LINES}}}),
        "vocab": Manifest(stage="vocab", key="v", dir="", outputs={"model": assets["spm"]}),
    }
    return StageContext(name="translate", key="t", cfg=cfg, out_dir=str(out), inputs=inputs)


def _reference_hyps(assets, ctx) -> list[str]:
    """The same planned batches decoded in a plain loop (no Ray), mapped back to source order."""
    torch.set_num_threads(1)  # as in the actors: same kernels, same numbers
    tr = Translator(str(assets["model_dir"] / "model.pt"), assets["cfg"].to_dict(), assets["spm"],
                    {"beam_size": 2, "alpha": 0.6, "max_len_a": 1.0, "max_len_b": MAX_LEN_B})
    df = read_split(str(assets["split_dir"]), ["idx", "src_ids"])
    max_len = max_source_len(MAX_POSITIONS, 1.0, MAX_LEN_B)
    rows, _ = plan_split("test", df, max_len, 3, ctx.cfg.decode.batch_tokens)
    out = [""] * NUM_LINES
    for _, group in rows.groupby("batch_id", sort=False):
        for i, h in zip(group["idx"], tr.translate_ids([list(s) for s in group["src_ids"]])):
            out[i] = h
    return out


def test_two_workers_give_the_one_worker_hypotheses_in_source_order(assets, tmp_path, ray_local):
    results = {}
    for n in (1, 2):
        ctx = _ctx(assets, tmp_path, n)
        res = translate.run(ctx)
        split = res.outputs["splits"]["test"]
        results[n] = Path(split["hyps"]).read_text(encoding="utf-8").split("\n")[:-1]
        assert len(results[n]) == NUM_LINES
        assert split["num_sentences"] == NUM_LINES
        assert split["num_empty"] == 2 and split["num_truncated"] == 1 and split["num_failed"] == 0
        assert res.metrics["test/num_truncated"] == 1.0
        assert "train_final_step" not in res.outputs and "averaged" not in res.outputs  # score reads them at source
    assert results[1] == results[2]
    assert results[1][3] == "" and results[1][17] == ""
    assert results[1] == _reference_hyps(assets, ctx)
    assert len(set(results[1])) > NUM_LINES // 2  # hypotheses differ by source: an order shift would show

    # score reads translate's hypotheses, encode's references, and the facts of average and train
    # from those stages' own outputs: the chain holds together.
    train_out = {"final_step": 20, "model_config": assets["cfg"].to_dict(), "wall_s": 0.0}
    score_ctx = StageContext(name="score", key="s", cfg=ctx.cfg, out_dir=str(tmp_path / "score"), inputs={
        "translate": Manifest(stage="translate", key="t", dir=ctx.out_dir, outputs=res.outputs),
        "encode": ctx.inputs["encode"], "average": ctx.inputs["average"],
        "train": Manifest(stage="train", key="tr", dir="", outputs=train_out)})
    scored = score.run(score_ctx)
    assert set(scored.metrics) == {"test/bleu_sacre", "test/bleu_tok_cs", "test/chrf"}
    report = (tmp_path / "score" / "report.md").read_text()
    assert "20 steps" in report and f"d_model {assets['cfg'].d_model}" in report
    assert "2 empty sources, 1 truncated" in report


def test_cli_translates_stdin_line_by_line(assets):
    lines = [assets["src"][0], "", assets["src"][9], assets["src"][1]]
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline.decoding.translate_cli", "--model-dir", str(assets["model_dir"]),
         "--spm", assets["spm"], "--beam", "2", "--max-len-b", str(MAX_LEN_B), "--device", "cpu"],
        input="\n".join(lines) + "\n", capture_output=True, text=True, cwd=REPO, timeout=120, check=True)
    out = proc.stdout.split("\n")[:-1]
    assert len(out) == 4 and out[1] == ""
    assert "1 empty, 1 truncated" in proc.stderr
    # The reference: each line translated alone by the Translator (defaults alpha 0.6, max_len_a 1),
    # its pieces cut by hand to the longest source the model takes (eos kept), as the CLI reports.
    tr = Translator(str(assets["model_dir"] / "model.pt"), assets["cfg"].to_dict(), assets["spm"],
                    {"beam_size": 2, "alpha": 0.6, "max_len_a": 1.0, "max_len_b": MAX_LEN_B})
    longest = max_source_len(MAX_POSITIONS, 1.0, MAX_LEN_B)
    want = [tr.translate_ids([tr.sp.encode(line)[: longest - 1] + [tr.cfg.eos_id]])[0] if line else ""
            for line in lines]
    assert sum(len(tr.sp.encode(line)) + 1 > longest for line in lines) == 1  # the truncated one is there
    assert out == want
