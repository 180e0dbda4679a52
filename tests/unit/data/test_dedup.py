"""Dedup (first occurrence wins) against a plain Python set, and the segment cut against byte_lines."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.data import dedup
from pipeline.data.clean import Segment, byte_lines, read_pair_chunks, segment_offsets
from pipeline.data.fetch import DataError


def _reference_keep(chunks: list[np.ndarray]) -> list[list[bool]]:
    seen: set[int] = set()
    out = []
    for hashes in chunks:
        keep = []
        for h in hashes.tolist():
            keep.append(h not in seen)
            seen.add(h)
        out.append(keep)
    return out


@pytest.mark.parametrize("num_buckets, buffer_pairs", [(1, 1 << 20), (256, 7), (16, 1)])
def test_duplicates_are_every_repeat_after_the_first(num_buckets, buffer_pairs):
    rng = np.random.default_rng(0)
    pool = rng.integers(0, 2**64, size=300, dtype=np.uint64)  # repeats across and within chunks
    chunks = [rng.choice(pool, size=n) for n in (50, 0, 120, 1, 400)]
    d = dedup.Deduper(num_buckets, buffer_pairs)
    try:
        for c in chunks:
            d.add(c)
        dups = d.duplicates()
        assert len(list(d.dir.glob("*.bin"))) <= num_buckets  # spilled by hash bucket, not held
    finally:
        d.close()
    assert not d.dir.exists()
    got, pos = [], 0
    for c in chunks:
        got.append(dedup.keep_mask(dups, pos, len(c)).tolist())
        pos += len(c)
    assert got == _reference_keep(chunks)
    assert len(dups) == sum(len(c) for c in chunks) - len(set(np.concatenate(chunks).tolist()))


def test_no_duplicates_and_empty_input():
    d = dedup.Deduper()
    d.add(np.arange(10, dtype=np.uint64) << np.uint64(56))  # spread over the top bits (buckets)
    assert dedup.keep_mask(d.duplicates(), 0, 10).all()
    d.close()
    empty = dedup.Deduper()
    assert len(empty.duplicates()) == 0
    empty.close()


def _write(path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


@pytest.mark.parametrize("ending", [b"\n", b"\r\n"])
@pytest.mark.parametrize("final_newline", [True, False])
@pytest.mark.parametrize("num_lines, every, max_lines", [(0, 3, 0), (1, 1, 0), (10, 3, 0), (9, 3, 0),
                                                        (10, 4, 6), (10, 4, 8), (10, 20, 0), (7, 2, 100)])
def test_segments_cover_exactly_the_lines_byte_lines_reads(tmp_path, ending, final_newline, num_lines, every,
                                                           max_lines):
    lines = [f"{i} {'é' * (i % 4)}".encode() for i in range(1, num_lines + 1)]
    data = ending.join(lines) + (ending if final_newline and lines else b"")
    src, tgt = _write(tmp_path / "s", data), _write(tmp_path / "t", data.upper())
    segments, n = segment_offsets(src, tgt, every, max_lines)
    expected = list(byte_lines(src))
    assert n == len(expected) == num_lines
    covered = expected[:max_lines] if max_lines else expected
    assert all(s.num_lines <= every for s in segments) and len(segments) == -(-len(covered) // every)
    rows = [r for seg in segments for t in read_pair_chunks("c", src, tgt, 2, segment=seg) for r in t.to_pylist()]
    assert [r["src"].encode() for r in rows] == covered
    assert [r["tgt"].encode() for r in rows] == [x.upper() for x in covered]  # bytes.upper: ASCII only
    assert [r["line"] for r in rows] == list(range(1, len(covered) + 1))


def test_misaligned_files_are_caught_by_the_index(tmp_path):
    src, tgt = _write(tmp_path / "s", b"a\nb\nc\n"), _write(tmp_path / "t", b"a\nb\n")
    with pytest.raises(DataError, match=r"misaligned corpus: .*s has 3 lines but .*t has 2"):
        segment_offsets(src, tgt, 2)
    seg = Segment(1, 3, 0, 0)  # a segment past the end of one file (it changed after indexing)
    with pytest.raises(DataError, match="misaligned"):
        list(read_pair_chunks("c", src, tgt, 10, segment=seg))
