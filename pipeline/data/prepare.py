"""Stage ``prepare``: aligned, cleaned sentence pairs as Parquet shards per split.

How it streams (memory does not grow with the corpus):
1. One Ray task per file pair (corpus) reads both files in lockstep, ``CHUNK_LINES`` lines at a
   time, cleans each chunk with the pure ``text_clean.clean_batch`` and writes the kept rows as a
   staging Parquet file under ``<out_dir>/_staging``. A task holds one chunk; tasks run in
   parallel across corpora (``run.data_num_cpus`` each). Reading two files line by line in
   lockstep is sequential by nature, so a corpus is the natural unit of parallelism; Ray Data's
   ``read_text`` splits files independently and cannot pair them.
2. The driver merges the staging chunks in a fixed order (corpora in registry order, chunks in
   line order): drops duplicates (``data.dedup``, hashes only), numbers rows (``idx``) and routes
   them to ``data.num_shards`` deterministic shards (``data_shards``). It holds one chunk, plus
   8 bytes per kept pair when deduplicating. The staging folder is removed at the end.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline import storage
from pipeline.data.fetch import DataError
from pipeline.data.shards import ShardWriter
from pipeline.stage import StageContext, StageResult
from pipeline.data.clean import RULES, TEXT_SCHEMA, Deduper, ReadReport, clean_batch, pair_hashes, read_pair_chunks

log = logging.getLogger(__name__)

CHUNK_LINES = 20_000  # lines per chunk a task holds: memory is bounded by this, not by the corpus
SCHEMA = pa.schema([("idx", pa.int64()), *TEXT_SCHEMA])


def clean_corpus(split: str, corpus: str, src: str, tgt: str, staging_dir: str, max_words: int,
                 max_length_ratio: float, max_lines: int = 0, chunk_lines: int = CHUNK_LINES) -> dict[str, Any]:
    """Read, clean and stage one file pair; the summary says what was read, kept and dropped.

    The test split is flagged, not filtered, and must be valid UTF-8 (``text_clean``).
    """
    is_test = split == "test"
    report = ReadReport()
    fs, base = storage.resolve(staging_dir)
    if not storage.is_remote(staging_dir):
        fs.create_dir(base, recursive=True)
    counts = {rule: 0 for rule in RULES}
    chunks: list[dict[str, Any]] = []
    for i, table in enumerate(read_pair_chunks(corpus, src, tgt, chunk_lines, max_lines,
                                               strict_utf8=is_test, report=report)):
        kept, dropped = clean_batch(table, max_words, max_length_ratio, drop=not is_test)
        for rule, n in dropped.items():
            counts[rule] += n
        path = f"{base}/chunk-{i:05d}.parquet"
        pq.write_table(kept, path, filesystem=fs)
        chunks.append({"uri": storage.join(staging_dir, f"chunk-{i:05d}.parquet"), "rows": kept.num_rows})
    num_read = min(report.num_lines, max_lines) if max_lines else report.num_lines
    num_kept = sum(c["rows"] for c in chunks)
    if num_kept == 0:
        raise DataError(f"{split} corpus {corpus} is empty after cleaning: {num_read} pairs read from "
                        f"{src} and {tgt}, dropped {counts}")
    return {"split": split, "corpus": corpus, "src": src, "tgt": tgt, "num_lines": report.num_lines,
            "num_read": num_read, "num_kept": num_kept, "counts": counts, "chunks": chunks,
            "invalid_utf8": report.invalid_utf8, "num_invalid_utf8": report.num_invalid_utf8}


def _jobs(ctx: StageContext) -> list[tuple[str, dict[str, str]]]:
    files = ctx.inputs["download"].outputs
    return [("train", c) for c in files["train"]] + [("dev", files["dev"]), ("test", files["test"])]


def _run_tasks(ctx: StageContext, staging: str) -> list[Any]:
    """Start one Ray task per file pair; returns their refs in the fixed job order."""
    import ray

    from pipeline.ray_env import ensure_ray

    ensure_ray(ctx.cfg)
    d = ctx.cfg.data
    task = ray.remote(clean_corpus).options(num_cpus=ctx.cfg.run.data_num_cpus, max_retries=0)
    refs = []
    for i, (split, f) in enumerate(_jobs(ctx)):
        max_lines = d.max_pairs_per_corpus if split == "train" else 0
        refs.append(task.remote(split, f["corpus"], f["src"], f["tgt"], storage.join(staging, f"{i:03d}-{split}"),
                                d.max_words, d.max_length_ratio, max_lines))
    return refs


def run(ctx: StageContext) -> StageResult:
    from pipeline.data.ray_errors import get_data_error

    d = ctx.cfg.data
    out_dir = storage.absolute(ctx.out_dir)
    staging = storage.join(out_dir, "_staging")
    refs = _run_tasks(ctx, staging)
    writers = {s: ShardWriter(storage.join(out_dir, s), d.num_shards, SCHEMA) for s in ("train", "dev", "test")}
    deduper = Deduper()
    by_corpus: dict[str, dict[str, int]] = {}
    by_split = {s: {rule: 0 for rule in RULES} for s in writers}
    num_read = {s: 0 for s in writers}
    for ref in refs:
        summary = get_data_error(ref)
        split, corpus = summary["split"], summary["corpus"]
        counts = dict(summary["counts"])
        for chunk in summary["chunks"]:
            counts["duplicate"] += _merge_chunk(chunk["uri"], writers[split],
                                                deduper if (d.dedup and split == "train") else None)
        _log_corpus(summary, counts)
        if split != "test":
            by_corpus[corpus] = counts
        num_read[split] += summary["num_read"]
        for rule, n in counts.items():
            by_split[split][rule] += n
    splits = {}
    for split, writer in writers.items():
        writer.close()
        splits[split] = {"dir": writer.dir_uri, "num_rows": writer.num_rows, "num_shards": d.num_shards,
                         "num_read": num_read[split]}
    storage.rmtree(staging)
    dropped = {rule: by_split["train"][rule] + by_split["dev"][rule] for rule in RULES}
    outputs = {"splits": splits, "dropped": dropped, "dropped_by_corpus": by_corpus,
               "dropped_by_split": {s: by_split[s] for s in ("train", "dev")}, "flagged_test": by_split["test"]}
    metrics = {f"prepare/{s}_rows": float(v["num_rows"]) for s, v in splits.items()}
    metrics.update({f"prepare/dropped_{rule}": float(n) for rule, n in dropped.items()})
    return StageResult(outputs=outputs, metrics=metrics)


def _merge_chunk(uri: str, writer: ShardWriter, deduper: Deduper | None) -> int:
    """Number the rows of one staging chunk and shard them; returns the duplicates dropped."""
    fs, path = storage.resolve(uri)
    table = pq.read_table(path, filesystem=fs, schema=TEXT_SCHEMA)
    num_dups = 0
    if deduper is not None and table.num_rows:
        keep = deduper.keep_mask(pair_hashes(table))
        num_dups = int((~keep).sum())
        table = table.filter(pa.array(keep))
    start = writer.num_rows
    idx = pa.array(np.arange(start, start + table.num_rows, dtype=np.int64))
    writer.write(table.add_column(0, "idx", idx))
    return num_dups


def _log_corpus(summary: dict[str, Any], counts: dict[str, int]) -> None:
    split, corpus = summary["split"], summary["corpus"]
    verb = "flagged (kept, never filtered)" if split == "test" else "dropped"
    num_kept = summary["num_kept"] - (counts["duplicate"] if split != "test" else 0)
    log.info("prepare %s/%s: %d pairs read, %d kept; %s %s", split, corpus, summary["num_read"], num_kept,
             verb, ", ".join(f"{r}={n}" for r, n in counts.items()))
    if summary["num_invalid_utf8"]:
        log.warning("prepare %s/%s: %d lines of invalid UTF-8 counted as invalid_text (first: %s)", split,
                    corpus, summary["num_invalid_utf8"], ", ".join(summary["invalid_utf8"][:3]))
