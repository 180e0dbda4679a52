"""`train` refuses inputs that cannot work, in the driver, before any Ray worker starts."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.train import driver as train
from pipeline.config import Config
from pipeline.stage import Manifest, StageContext
from pipeline.train.corpus import id_range
from pipeline.train.inputs import TrainInputError
from tests.support.synthetic import write_reverse_task

VOCAB = 64


@pytest.fixture(autouse=True)
def no_training(monkeypatch):
    """Any call into Ray Train fails the test: every error here must come first."""
    def forbidden(*a, **k):
        raise AssertionError("training started")
    monkeypatch.setattr(train, "fit", forbidden)


def context(tmp_path, train_dir, dev_dir="", **overrides) -> StageContext:
    cfg = Config()
    cfg.model.d_model, cfg.model.d_ff, cfg.model.n_heads = 32, 64, 2
    cfg.train.tokens_per_step, cfg.speed.max_tokens_per_batch, cfg.workers.num_workers = 500, 200, 1
    for k, v in overrides.items():  # a train field by name, a speed field as speed_<field>
        section, name = (cfg.speed, k[len("speed_"):]) if k.startswith("speed_") else (cfg.train, k)
        assert hasattr(section, name), k
        setattr(section, name, v)
    splits = {"train": {"dir": str(train_dir)}}
    if dev_dir:
        splits["dev"] = {"dir": str(dev_dir)}
    inputs = {"encode": Manifest(stage="encode", key="e", dir=str(tmp_path), outputs={"splits": splits}),
              "vocab": Manifest(stage="vocab", key="v", dir=str(tmp_path),
                                outputs={"vocab_size": VOCAB, "pad_id": 0, "bos_id": 2,
                                                              "eos_id": 3})}
    return StageContext(name="train", key="key", cfg=cfg, out_dir=str(tmp_path / "out"), inputs=inputs)


def test_ids_outside_the_vocabulary(tmp_path):
    bad = write_reverse_task(tmp_path / "train", 50, VOCAB, id_offset=VOCAB)
    with pytest.raises(TrainInputError, match=r"ids in \[\d+, \d+\] but the vocabulary has 64"):
        train.run(context(tmp_path, bad))


def test_ids_outside_the_vocabulary_in_the_dev_split(tmp_path):
    good = write_reverse_task(tmp_path / "train", 50, VOCAB)
    bad = write_reverse_task(tmp_path / "dev", 10, VOCAB, id_offset=10)
    with pytest.raises(TrainInputError, match="the dev shards"):
        train.run(context(tmp_path, good, bad))


def test_id_range_without_parquet_statistics(tmp_path):
    table = pa.table({"src_ids": pa.array([[5, 70]], pa.list_(pa.int32())),
                      "tgt_ids": pa.array([[4]], pa.list_(pa.int32()))})
    (tmp_path / "s").mkdir()
    pq.write_table(table, tmp_path / "s" / "part-0.parquet", write_statistics=False)
    assert id_range(str(tmp_path / "s")) == (4, 70)


def test_empty_training_set(tmp_path):
    empty = write_reverse_task(tmp_path / "train", 0, VOCAB, num_shards=1)
    with pytest.raises(TrainInputError, match="is empty"):
        train.run(context(tmp_path, empty))
    (tmp_path / "none").mkdir()
    with pytest.raises(TrainInputError, match="no Parquet shards"):
        train.run(context(tmp_path, tmp_path / "none"))


def test_every_pair_longer_than_max_len(tmp_path):
    shards = write_reverse_task(tmp_path / "train", 20, VOCAB, min_len=10, max_len=12)
    with pytest.raises(TrainInputError, match="longer than train.max_len=5"):
        train.run(context(tmp_path, shards, max_len=5))


def test_tokens_per_step_smaller_than_one_sentence(tmp_path):
    shards = write_reverse_task(tmp_path / "train", 20, VOCAB, min_len=10, max_len=12)
    with pytest.raises(TrainInputError, match="tokens_per_step=8 is smaller than one training pair"):
        train.run(context(tmp_path, shards, tokens_per_step=8))


def test_batch_cap_smaller_than_the_longest_pair(tmp_path):
    shards = write_reverse_task(tmp_path / "train", 20, VOCAB, min_len=10, max_len=12)
    with pytest.raises(TrainInputError, match="max_tokens_per_batch=10 is smaller than the longest"):
        train.run(context(tmp_path, shards, speed_max_tokens_per_batch=10))


def test_max_len_beyond_the_model_positions(tmp_path):
    shards = write_reverse_task(tmp_path / "train", 20, VOCAB)
    with pytest.raises(TrainInputError, match="exceeds model.max_positions"):
        train.run(context(tmp_path, shards, max_len=2000))


def test_early_stopping_on_a_metric_the_run_will_not_have(tmp_path):
    shards = write_reverse_task(tmp_path / "train", 20, VOCAB)
    with pytest.raises(TrainInputError, match="early_stop_metric = 'val_loss', but this run has no such metric: "
                                              "the encode stage has no dev split"):
        train.run(context(tmp_path, shards, early_stop_patience=2, early_stop_metric="val_loss"))
    dev = write_reverse_task(tmp_path / "dev", 10, VOCAB)
    with pytest.raises(TrainInputError, match="'dev_bleu', but .* names no SentencePiece model"):
        train.run(context(tmp_path, shards, dev, early_stop_patience=2, early_stop_metric="dev_bleu"))
    with pytest.raises(AssertionError, match="training started"):  # a dev split: the dev loss exists
        train.run(context(tmp_path, shards, dev, early_stop_patience=2, early_stop_metric="val_loss"))
