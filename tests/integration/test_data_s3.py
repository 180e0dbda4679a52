"""The data stages' file handling against an S3 work dir and an S3 mirror (moto_server), without Ray.

Ray workers of an already-running test session would not see the S3 endpoint (tests/support/s3.py),
so the Ray-free parts are driven directly: the ``download`` stage, ``prepare``'s per-corpus task
function and merge, the vocab sample, and the encoder. What lands in the bucket is listed with boto3.
"""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest

from pipeline import storage
from pipeline.data import download, prepare
from pipeline.config import Config
from pipeline.data.shards import ShardWriter, shard_uris
from pipeline.stage import StageContext
from pipeline.data.vocab import write_sample
from tests.support.s3 import s3, s3_module  # noqa: F401 (fixtures)

# The bound on each test (pytest-timeout): the data stages on an S3 server.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_download_and_prepare_on_s3(s3, mirror_dir, tmp_path):
    mirror = s3.uri("mirror")
    storage.upload(mirror_dir, mirror)
    cfg = Config()
    cfg.data.mirror = mirror
    cfg.run.work_dir = s3.uri("wd")
    out = download.run(StageContext(name="download", key="k", cfg=cfg, out_dir=s3.uri("wd/download/k"),
                                    inputs={})).outputs
    assert out["test"]["src"] == s3.uri("wd/download/k/test/newstest2014/newstest2014-deen-src.en.sgm")
    assert "wd/download/k/dev/newstest2013/newstest2013.de" in s3.keys("wd/download/k/")

    dev = prepare.clean_corpus("dev", "newstest2013", out["dev"]["src"], out["dev"]["tgt"],
                               s3.uri("wd/prepare/k/_staging/dev"), 250, 3.0, chunk_lines=1000)
    test = prepare.clean_corpus("test", "newstest2014", out["test"]["src"], out["test"]["tgt"],
                                s3.uri("wd/prepare/k/_staging/test"), 250, 3.0)
    assert dev["num_read"] == 3000 and len(dev["chunks"]) == 3 and test["num_kept"] == 3003

    writer = ShardWriter(s3.uri("wd/prepare/k/dev"), 2, prepare.SCHEMA)
    for chunk in dev["chunks"]:
        prepare._merge_chunk(chunk["uri"], writer, None)
    paths = writer.close()
    assert writer.num_rows == dev["num_kept"]
    assert s3.keys("wd/prepare/k/dev/") == ["wd/prepare/k/dev/part-00000-of-00002.parquet",
                                            "wd/prepare/k/dev/part-00001-of-00002.parquet"]
    assert shard_uris(s3.uri("wd/prepare/k/dev")) == paths
    fs, path = storage.resolve(paths[1])
    assert pq.read_table(path, filesystem=fs).column("idx").to_pylist()[:3] == [1, 3, 5]

    sample = tmp_path / "sample.txt"
    assert write_sample(s3.uri("wd/prepare/k/dev"), np.array([0, 1, 2], dtype=np.int64), sample) == 6
    assert sample.read_text().splitlines()[0] == "A Republican strategy to counter the re-election of Obama"
