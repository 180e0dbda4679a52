"""Stage ``encode``: sentence pairs -> SentencePiece id lists, as deterministic Parquet shards.

Ray Data reads ``prepare``'s shards of all three splits in order (one pipeline, so the actor
pool starts once), ``Encoder`` actors (each loads the model once) map batches, and the driver
routes the encoded rows to the same shard layout as ``prepare`` (``data_shards``: shard =
idx % num_shards, fixed row groups). With ``preserve_order`` the row sequence is fixed, and the
fixed row groups make the files byte-identical across runs whatever the block sizes on the way.
Ids are pieces only: the model adds bos/eos (docs/stages.md).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline import storage
from pipeline.data.shards import ShardWriter, shard_uris
from pipeline.stage import StageContext, StageResult

log = logging.getLogger(__name__)

BATCH_ROWS = 2048
BLOCK_BYTES = 8 * 2**20  # Ray Data target block size while encoding
IDS = pa.list_(pa.int32())
SCHEMA = pa.schema([("idx", pa.int64()), ("src_ids", IDS), ("tgt_ids", IDS),
                    ("src_len", pa.int32()), ("tgt_len", pa.int32())])
TEXT_SCHEMA = pa.schema([*SCHEMA, ("src", pa.string()), ("tgt", pa.string())])
SPLITS = ("train", "dev", "test")


def ids_array(ids: list[list[int]]) -> tuple[pa.Array, np.ndarray]:
    """Python id lists -> (list<int32> array, lengths), without a Python loop per id."""
    lengths = np.fromiter(map(len, ids), dtype=np.int32, count=len(ids))
    offsets = np.zeros(len(ids) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    values = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int32, count=int(offsets[-1]))
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values), type=IDS), lengths


class Encoder:
    """Callable class for ``map_batches``: loads the SentencePiece model once per actor.

    Batches may mix files of several splits (one pipeline serves all three, so the actor pool
    starts once); ``split_dirs`` maps each split's folder to its name, found from the ``path``
    column. Text is kept only for ``text_splits`` (null elsewhere, so it costs nothing to ship).
    """

    def __init__(self, model_uri: str, split_dirs: dict[str, str], text_splits: tuple[str, ...] = ("dev", "test"),
                 num_threads: int = 1):
        import sentencepiece as spm

        self.sp = spm.SentencePieceProcessor(model_file=str(storage.local_copy(model_uri)))
        self.split_dirs, self.text_splits, self.num_threads = split_dirs, text_splits, num_threads

    def _split_of(self, path: str) -> str:
        for d, split in self.split_dirs.items():
            if path.startswith(d.rstrip("/") + "/"):
                return split
        raise ValueError(f"{path} is in none of the split folders {list(self.split_dirs)}")

    def __call__(self, batch: pa.Table) -> pa.Table:
        src, tgt = batch.column("src").to_pylist(), batch.column("tgt").to_pylist()
        src_ids, src_len = ids_array(self.sp.encode(src, out_type=int, num_threads=self.num_threads))
        tgt_ids, tgt_len = ids_array(self.sp.encode(tgt, out_type=int, num_threads=self.num_threads))
        split_of = {p: self._split_of(p) for p in set(batch.column("path").to_pylist())}
        split = pa.array([split_of[p] for p in batch.column("path").to_pylist()], pa.string())
        keep_text = pc.is_in(split, pa.array(self.text_splits, pa.string()))
        return pa.table({"split": split, "idx": batch.column("idx"), "src_ids": src_ids, "tgt_ids": tgt_ids,
                         "src_len": pa.array(src_len), "tgt_len": pa.array(tgt_len),
                         "src": pc.if_else(keep_text, batch.column("src"), None),
                         "tgt": pc.if_else(keep_text, batch.column("tgt"), None)})


def encoded_batches(ctx: StageContext, split_dirs: dict[str, str], model_uri: str) -> Iterator[pa.Table]:
    """Every split's rows, encoded, in shard order (train, dev, test), as pyarrow batches."""
    import ray

    uris = [u for d in split_dirs for u in shard_uris(d)]
    fs, _ = storage.resolve(uris[0])
    paths = [storage.resolve(u)[1] for u in uris]
    by_path = {storage.resolve(d)[1]: split for d, split in split_dirs.items()}
    ds = ray.data.read_parquet(paths, filesystem=fs, include_paths=True).select_columns(["idx", "src", "tgt", "path"])
    ds = ds.map_batches(Encoder, fn_constructor_args=(model_uri, by_path),
                        fn_constructor_kwargs={"num_threads": max(1, int(ctx.cfg.run.data_num_cpus))},
                        batch_size=BATCH_ROWS, batch_format="pyarrow",
                        compute=ray.data.ActorPoolStrategy(size=ctx.cfg.run.data_concurrency),
                        num_cpus=ctx.cfg.run.data_num_cpus)
    yield from ds.iter_batches(batch_format="pyarrow", batch_size=None)


@contextlib.contextmanager
def _ordered_small_blocks() -> Iterator[None]:
    """Ray Data set up for encoding while inside; the driver's settings restored on the way out."""
    import ray

    data_ctx = ray.data.DataContext.get_current()
    saved = (data_ctx.execution_options.preserve_order, data_ctx.target_max_block_size,
             data_ctx.use_datasource_v2)
    data_ctx.execution_options.preserve_order = True  # the row sequence fixes the shards' bytes
    # Small blocks keep read, encode and the driver's writes pipelined and memory flat (with the
    # default 128 MiB a whole shard is one block: slower, and a higher peak memory).
    data_ctx.target_max_block_size = BLOCK_BYTES
    # Ray 2.60's default Parquet reader (DataSourceV2) lists files through a pool of 32
    # FooterReader actors (RAY_DATA_PARQUET_FOOTER_NUM_ACTORS) for every read: 32 processes, each
    # importing ray.data, for a few dozen shards whose footers we wrote ourselves; on a 2-core
    # machine that is most of the stage. The V1 reader reads the same files with no actors
    # (docs/benchmarks.md, "Process start-up").
    data_ctx.use_datasource_v2 = False
    try:
        yield
    finally:
        (data_ctx.execution_options.preserve_order, data_ctx.target_max_block_size,
         data_ctx.use_datasource_v2) = saved


def _shard_writers(prepared: dict, out_dir: str) -> dict[str, ShardWriter]:
    """One writer per split, with ``prepare``'s number of shards; dev and test keep their text."""
    writers = {}
    for split in SPLITS:
        info = prepared[split]
        num_shards = info.get("num_shards") or len(shard_uris(info["dir"]))
        schema = TEXT_SCHEMA if split in ("dev", "test") else SCHEMA
        writers[split] = ShardWriter(storage.join(out_dir, split), num_shards, schema)
    return writers


def _write_all(batches: Iterator[pa.Table], writers: dict[str, ShardWriter]) -> dict[str, list[int]]:
    """Routes each encoded batch's rows to their split's writer; returns [src, tgt] tokens per split.

    Logs progress every 10 s."""
    tokens = {s: [0, 0] for s in SPLITS}
    t0 = last = time.monotonic()
    for batch in batches:
        split_col = batch.column("split")
        names = pc.unique(split_col).to_pylist()
        for split in names:
            part = batch.filter(pc.equal(split_col, split)) if len(names) > 1 else batch
            writers[split].write(part)
            tokens[split][0] += int(pc.sum(part.column("src_len")).as_py() or 0)
            tokens[split][1] += int(pc.sum(part.column("tgt_len")).as_py() or 0)
        if time.monotonic() - last > 10:
            last = time.monotonic()
            done = sum(w.num_rows for w in writers.values())
            log.info("encode: %d rows, %.0f rows/s", done, done / (last - t0))
    return tokens


def _close_writers(writers: dict[str, ShardWriter], prepared: dict, tokens: dict[str, list[int]]) -> dict:
    """Closes the writers, checks each split kept ``prepare``'s row count; the ``splits`` output."""
    splits = {}
    for split, writer in writers.items():
        writer.close()
        if writer.num_rows != prepared[split]["num_rows"]:
            raise RuntimeError(f"encode {split}: wrote {writer.num_rows} rows, "
                               f"prepare has {prepared[split]['num_rows']}")
        splits[split] = {"dir": writer.dir_uri, "num_rows": writer.num_rows, "num_src_tokens": tokens[split][0],
                         "num_tgt_tokens": tokens[split][1], "num_shards": writer.num_shards}
        log.info("encode %s: %d rows, %d src / %d tgt tokens", split, writer.num_rows, *tokens[split])
    return splits


def run(ctx: StageContext) -> StageResult:
    from pipeline.ray_env import ensure_ray

    ensure_ray(ctx.cfg)
    prepared = ctx.inputs["prepare"].outputs["splits"]
    vocab = ctx.inputs["vocab"].outputs
    writers = _shard_writers(prepared, storage.absolute(ctx.out_dir))
    t0 = time.monotonic()
    with _ordered_small_blocks():
        batches = encoded_batches(ctx, {prepared[s]["dir"]: s for s in SPLITS}, vocab["model"])
        tokens = _write_all(batches, writers)
    splits = _close_writers(writers, prepared, tokens)
    log.info("encode: done in %.1fs", time.monotonic() - t0)
    outputs = {"splits": splits, "vocab_size": vocab["vocab_size"], "pad_id": vocab["pad_id"],
               "unk_id": vocab.get("unk_id", 1), "bos_id": vocab["bos_id"], "eos_id": vocab["eos_id"]}
    metrics = {f"encode/{s}_{k}": float(v[k]) for s, v in splits.items()
               for k in ("num_rows", "num_src_tokens", "num_tgt_tokens")}
    return StageResult(outputs=outputs, metrics=metrics)
