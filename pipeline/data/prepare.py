"""Stage ``prepare``: aligned, cleaned sentence pairs as Parquet shards per split.

How it streams (memory does not grow with the corpus):
1. Ray tasks read file pairs in lockstep, ``CHUNK_LINES`` lines at a time, clean each chunk with
   the pure ``clean.clean_batch`` and write the kept rows as a staging Parquet file under
   ``<out_dir>/_staging``. A task holds one chunk (``run.data_num_cpus`` CPUs each). A small corpus
   is one task. A training corpus of ``SEGMENT_MIN_BYTES`` or more (Giga: 22.5M pairs) is first
   indexed (one pass that only counts newlines, ``clean.segment_offsets``) and then cleaned as
   segments of ``SEGMENT_LINES`` lines in parallel, each task seeking to its segment's first line
   in both files. The cut depends only on the files, so the output is the same on any cluster.
2. The driver merges the staging chunks in a fixed order (corpora in registry order, segments and
   chunks in line order, exactly the order of one serial reader): drops duplicates
   (``data.dedup``, ``pipeline.data.dedup``: O(n), bounded memory, hashes computed in the tasks),
   numbers rows (``idx``) and routes them to ``data.num_shards`` shards (``data.shards``: a
   shard's bytes depend only on its rows). Same files + config -> byte-identical shards, whether a
   corpus was one task or many. The staging folder is removed at the end.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline import storage
from pipeline.data import dedup
from pipeline.data.clean import (RULES, TEXT_SCHEMA, ReadReport, Segment, clean_batch, pair_hashes,
                                 read_pair_chunks, segment_offsets)
from pipeline.data.fetch import DataError
from pipeline.data.preprocess import preprocess_table
from pipeline.data.shards import ShardWriter
from pipeline.stage import StageContext, StageResult

log = logging.getLogger(__name__)

CHUNK_LINES = 20_000  # lines per chunk a task holds: memory is bounded by this, not by the corpus
SEGMENT_LINES = 250_000  # lines per parallel task within a large corpus (Giga: 91 segments)
SEGMENT_MIN_BYTES = 64 << 20  # a training corpus (both files) at least this large is cut into segments
SCHEMA = pa.schema([("idx", pa.int64()), *TEXT_SCHEMA])


def clean_pairs(split: str, corpus: str, src: str, tgt: str, staging_dir: str, max_words: int,
                max_length_ratio: float, max_lines: int = 0, chunk_lines: int = CHUNK_LINES,
                segment: Segment | None = None, with_hashes: bool = False, preprocess: str = "none",
                langs: tuple[str, str] = ("", "")) -> dict[str, Any]:
    """Read, clean and stage one file pair (or one ``segment`` of it); what was read, kept, dropped.

    ``preprocess`` (``data.preprocess``, for the languages ``langs``) rewrites both sides of every
    chunk before the cleaning rules see it (``pipeline.data.preprocess``). ``with_hashes`` adds each kept pair's 64-bit hash as a ``hash`` column (for dedup). The test
    split is flagged, not filtered, and must be valid UTF-8 (``clean``).
    """
    is_test = split == "test"
    report = ReadReport()
    fs, base = storage.resolve(staging_dir)
    if not storage.is_remote(staging_dir):
        fs.create_dir(base, recursive=True)
    counts = {rule: 0 for rule in RULES}
    chunks: list[dict[str, Any]] = []
    for i, table in enumerate(read_pair_chunks(corpus, src, tgt, chunk_lines, max_lines, strict_utf8=is_test,
                                               report=report, segment=segment)):
        table = preprocess_table(table, preprocess, *langs)
        kept, dropped = clean_batch(table, max_words, max_length_ratio, drop=not is_test)
        for rule, n in dropped.items():
            counts[rule] += n
        if with_hashes:
            kept = kept.append_column("hash", pa.array(pair_hashes(kept), pa.uint64()))
        pq.write_table(kept, f"{base}/chunk-{i:05d}.parquet", filesystem=fs)
        chunks.append({"uri": storage.join(staging_dir, f"chunk-{i:05d}.parquet"), "rows": kept.num_rows})
    num_read = min(report.num_lines, max_lines) if max_lines else report.num_lines
    return {"split": split, "corpus": corpus, "src": src, "tgt": tgt, "num_lines": report.num_lines,
            "num_read": num_read, "num_kept": sum(c["rows"] for c in chunks), "counts": counts, "chunks": chunks,
            "invalid_utf8": report.invalid_utf8, "num_invalid_utf8": report.num_invalid_utf8}


def clean_corpus(split: str, corpus: str, src: str, tgt: str, staging_dir: str, max_words: int,
                 max_length_ratio: float, max_lines: int = 0, chunk_lines: int = CHUNK_LINES) -> dict[str, Any]:
    """``clean_pairs`` of a whole file pair, which must keep at least one pair."""
    summary = clean_pairs(split, corpus, src, tgt, staging_dir, max_words, max_length_ratio, max_lines, chunk_lines)
    _check_not_empty(summary)
    return summary


def _check_not_empty(s: dict[str, Any]) -> None:
    if s["num_kept"] == 0:
        raise DataError(f"{s['split']} corpus {s['corpus']} is empty after cleaning: {s['num_read']} pairs read "
                        f"from {s['src']} and {s['tgt']}, dropped {s['counts']}")


def combine(parts: list[dict[str, Any]], num_lines: int | None = None) -> dict[str, Any]:
    """One corpus summary from its segments' summaries (in line order)."""
    out = dict(parts[0])
    out["counts"] = {rule: sum(p["counts"][rule] for p in parts) for rule in RULES}
    out["chunks"] = [c for p in parts for c in p["chunks"]]
    for k in ("num_read", "num_kept", "num_invalid_utf8"):
        out[k] = sum(p[k] for p in parts)
    out["invalid_utf8"] = [w for p in parts for w in p["invalid_utf8"]][:10]
    out["num_lines"] = num_lines if num_lines is not None else sum(p["num_lines"] for p in parts)
    out["num_segments"] = len(parts)
    return out


def _jobs(ctx: StageContext) -> list[tuple[str, dict[str, str]]]:
    files = ctx.inputs["download"].outputs
    return [("train", c) for c in files["train"]] + [("dev", files["dev"]), ("test", files["test"])]


def _segmented(split: str, f: dict[str, str]) -> bool:
    """Large plain-text training corpora are cut into segments (a ``.gz`` file cannot seek)."""
    if split != "train" or any(f[s].endswith((".gz", ".sgm")) for s in ("src", "tgt")):
        return False
    sizes = []
    for side in ("src", "tgt"):
        fs, path = storage.resolve(f[side])
        sizes.append(fs.get_file_info(path).size or 0)
    return sum(sizes) >= SEGMENT_MIN_BYTES


def _run_tasks(ctx: StageContext, staging: str) -> list[tuple[list[Any], Any]]:
    """Start the cleaning tasks; per job (in the fixed job order): its refs in line order, and
    the ref of its line index (None for a one-task corpus). One-task corpora and the indexes
    start first; a segmented corpus's tasks start once its index is back."""
    import ray

    from pipeline.data.ray_errors import get_data_error
    from pipeline.ray_env import ensure_ray

    ensure_ray(ctx.cfg)
    d = ctx.cfg.data
    opts = {"num_cpus": ctx.cfg.run.data_num_cpus, "max_retries": 0}
    text = {"preprocess": d.preprocess, "langs": (d.src_lang, d.tgt_lang)}
    task, index = ray.remote(clean_pairs).options(**opts), ray.remote(segment_offsets).options(**opts)
    out: list[tuple[list[Any], Any]] = []
    for i, (split, f) in enumerate(_jobs(ctx)):
        limit = d.max_pairs_per_corpus if split == "train" else 0
        if _segmented(split, f):
            out.append(([], index.remote(f["src"], f["tgt"], SEGMENT_LINES, limit)))
        else:
            out.append(([task.remote(split, f["corpus"], f["src"], f["tgt"], storage.join(staging, f"{i:03d}-{split}"),
                                     d.max_words, d.max_length_ratio, limit, with_hashes=d.dedup and split == "train",
                                     **text)],
                        None))
    for i, ((refs, idx_ref), (split, f)) in enumerate(zip(out, _jobs(ctx))):
        if idx_ref is None:
            continue
        segments, _ = get_data_error(idx_ref)
        stage_dir = storage.join(staging, f"{i:03d}-{split}")
        refs += [task.remote(split, f["corpus"], f["src"], f["tgt"], storage.join(stage_dir, f"seg-{k:05d}"),
                             d.max_words, d.max_length_ratio, segment=seg, with_hashes=d.dedup, **text)
                 for k, seg in enumerate(segments)]
    return out


def run(ctx: StageContext) -> StageResult:
    from pipeline.data.ray_errors import get_data_error

    d = ctx.cfg.data
    out_dir = storage.absolute(ctx.out_dir)
    staging = storage.join(out_dir, "_staging")
    writers = {s: ShardWriter(storage.join(out_dir, s), d.num_shards, SCHEMA) for s in ("train", "dev", "test")}
    deduper = dedup.Deduper() if d.dedup else None
    summaries, deferred = [], []
    try:
        for refs, idx_ref in _run_tasks(ctx, staging):
            num_lines = get_data_error(idx_ref)[1] if idx_ref is not None else None
            summary = combine([get_data_error(r) for r in refs], num_lines)
            _check_not_empty(summary)
            summaries.append(summary)
            if deduper is not None and summary["split"] == "train":
                for chunk in summary["chunks"]:  # merged once every train chunk's hashes are in
                    deduper.add(_read(chunk["uri"], ["hash"]).column("hash").to_numpy())
                deferred.append(summary)
            else:
                _merge_corpus(summary, writers[summary["split"]])
        if deduper is not None:
            duplicates, pos = deduper.duplicates(), 0
            for summary in deferred:
                pos = _merge_corpus(summary, writers["train"], duplicates, pos)
    finally:
        if deduper is not None:
            deduper.close()
    return _result(d, summaries, writers, staging)


def _merge_corpus(summary: dict[str, Any], writer: ShardWriter, duplicates: np.ndarray | None = None,
                  pos: int = 0) -> int:
    """Merge a corpus's chunks (rows at dedup positions ``pos ..``); returns the next position."""
    summary["counts"] = dict(summary["counts"])
    for chunk in summary["chunks"]:
        keep = None if duplicates is None else dedup.keep_mask(duplicates, pos, chunk["rows"])
        summary["counts"]["duplicate"] += _merge_chunk(chunk["uri"], writer, keep)
        pos += chunk["rows"]
    _log_corpus(summary, summary["counts"])
    return pos


def _result(d: Any, summaries: list[dict[str, Any]], writers: dict[str, ShardWriter], staging: str) -> StageResult:
    by_corpus: dict[str, dict[str, int]] = {}
    by_split = {s: {rule: 0 for rule in RULES} for s in writers}
    num_read = {s: 0 for s in writers}
    for s in summaries:
        if s["split"] != "test":
            by_corpus[s["corpus"]] = s["counts"]
        num_read[s["split"]] += s["num_read"]
        for rule, n in s["counts"].items():
            by_split[s["split"]][rule] += n
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


def _read(uri: str, columns: list[str]) -> pa.Table:
    fs, path = storage.resolve(uri)
    return pq.read_table(path, filesystem=fs, columns=columns)


def _merge_chunk(uri: str, writer: ShardWriter, keep: np.ndarray | None = None) -> int:
    """Number the rows of one staging chunk (those ``keep`` marks) and shard them; returns the
    duplicates dropped."""
    table = _read(uri, TEXT_SCHEMA.names)
    num_dups = 0
    if keep is not None and table.num_rows:
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
    segments = f" in {summary['num_segments']} parallel segments" if summary.get("num_segments", 1) > 1 else ""
    log.info("prepare %s/%s: %d pairs read%s, %d kept; %s %s", split, corpus, summary["num_read"], segments,
             num_kept, verb, ", ".join(f"{r}={n}" for r, n in counts.items()))
    if summary["num_invalid_utf8"]:
        log.warning("prepare %s/%s: %d lines of invalid UTF-8 counted as invalid_text (first: %s)", split,
                    corpus, summary["num_invalid_utf8"], ", ".join(summary["invalid_utf8"][:3]))
