"""Pure text handling for ``prepare``: reading aligned file pairs in chunks, SGML, cleaning rules.

Nothing here imports Ray. Every dropped pair is counted under exactly one rule, checked in this
order (the first that fires wins):

- ``invalid_text``: a side holds bytes that are not UTF-8 (decoded as U+FFFD, and the file and
  line are logged), a control character (C0 but tab, DEL, C1) or U+FFFD itself;
- ``empty``: a side is empty after trimming whitespace;
- ``too_long``: a side has more than ``max_words`` whitespace-separated words;
- ``length_ratio``: max(words) / min(words) > ``max_length_ratio``;
- ``duplicate``: the exact (src, tgt) pair was kept before in the split (``pipeline.data.dedup``, train only).

The test split is never filtered and never changed: the same rules only *flag* its lines
(counted, logged), and invalid UTF-8 there is an error, since dropping or replacing a reference
line would silently change the benchmark.
"""

from __future__ import annotations

import itertools
import logging
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline import storage
from pipeline.data.fetch import DataError

log = logging.getLogger(__name__)

RULES = ("invalid_text", "empty", "too_long", "length_ratio", "duplicate")
# C0 controls except tab (\x09) and newline, DEL, C1 controls, and the replacement character.
INVALID_CHARS = r"[\x00-\x08\x0a-\x1f\x7f-\x9f\x{fffd}]"
WORD = r"[^\s\p{Z}]+"  # a run of non-whitespace; matches Python's str.split() on text without controls
READ_BLOCK_BYTES = 1 << 20
TEXT_SCHEMA = pa.schema([("corpus", pa.string()), ("line", pa.int64()), ("src", pa.string()), ("tgt", pa.string())])


def byte_lines(uri: str, offset: int = 0) -> Iterator[bytes]:
    """The lines of a file as bytes, without ``\\n`` (or ``\\r\\n``); streaming, any size.
    ``offset`` > 0 starts at that byte (a line start, from ``segment_offsets``; plain files only)."""
    rest = b""
    if offset:
        fs, path = storage.resolve(uri)
        opened = fs.open_input_file(path)
        opened.seek(offset)
    else:
        opened = storage.open_input(uri)
    with opened as f:
        for block in iter(lambda: f.read(READ_BLOCK_BYTES), b""):
            lines = (rest + block).split(b"\n")
            rest = lines.pop()
            for line in lines:
                yield line[:-1] if line.endswith(b"\r") else line
    if rest:
        yield rest[:-1] if rest.endswith(b"\r") else rest


def sgml_lines(uri: str) -> Iterator[bytes]:
    """The ``<seg>`` texts of a WMT "fake SGML" file, extracted by sacrebleu's own code.

    sacrebleu's ``FakeSGMLDataset._convert_format`` is what ``sacrebleu -t wmt14/full`` uses to
    build its references, so the test set read here is the one sacreBLEU scores against.
    """
    from sacrebleu.dataset import DATASETS
    from sacrebleu.dataset.fake_sgml import FakeSGMLDataset

    converter = DATASETS["wmt14/full"]
    assert isinstance(converter, FakeSGMLDataset)
    local = str(storage.local_copy(uri))
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "segments.txt")
        try:
            converter._convert_format(local, out)
        except UnicodeDecodeError as e:
            raise DataError(f"{uri}:{_first_invalid_line(local)}: invalid UTF-8 ({e.reason})") from e
        yield from byte_lines(out)


def _first_invalid_line(uri: str) -> int:
    for n, line in enumerate(byte_lines(uri), 1):
        try:
            line.decode("utf-8")
        except UnicodeDecodeError:
            return n
    return 0


def file_lines(uri: str) -> Iterator[bytes]:
    """Plain text or, by suffix, SGML (``.sgm``)."""
    return sgml_lines(uri) if uri.endswith(".sgm") else byte_lines(uri)


@dataclass
class ReadReport:
    """What reading one file pair found (filled in while the chunks are consumed)."""

    num_lines: int = 0
    invalid_utf8: list[str] = field(default_factory=list)  # "file:line", the first few
    num_invalid_utf8: int = 0


def _decode(lines: list[bytes], uri: str, first_line: int, strict: bool, report: ReadReport) -> pa.Array:
    """Bytes lines -> a string array; invalid UTF-8 becomes U+FFFD (and is reported) or an error."""
    arr = pa.array(lines, type=pa.binary())
    try:
        return arr.cast(pa.string())  # validates UTF-8 in C++: the common, fast path
    except pa.ArrowInvalid:
        pass
    out = []
    for i, b in enumerate(lines):
        try:
            out.append(b.decode("utf-8"))
        except UnicodeDecodeError as e:
            where = f"{uri}:{first_line + i}"
            if strict:
                raise DataError(f"{where}: invalid UTF-8 ({e.reason} at byte {e.start})") from e
            report.num_invalid_utf8 += 1
            if len(report.invalid_utf8) < 10:
                report.invalid_utf8.append(where)
                log.warning("%s: invalid UTF-8 (%s at byte %d): counted as invalid_text", where, e.reason, e.start)
            out.append(b.decode("utf-8", errors="replace"))
    return pa.array(out, type=pa.string())


@dataclass(frozen=True)
class Segment:
    """Lines ``first_line .. first_line + num_lines - 1`` (1-based) of a file pair, and where
    they start in each file (bytes): the unit one ``prepare`` task cleans."""

    first_line: int
    num_lines: int
    src_offset: int
    tgt_offset: int


def _line_starts(uri: str, every: int, limit: int = 0) -> tuple[list[int], int]:
    """Byte offsets of lines 1, 1 + every, 1 + 2 * every, ... (those <= ``limit``, 0 = all) and
    the file's line count, as ``byte_lines`` counts (a last line without ``\\n`` counts). One pass;
    a block's newlines are counted in C and only a segment's last newline is located."""
    starts, n, pos, last = [0], 0, 0, b"\n"
    with storage.open_input(uri, compression=None) as f:
        for block in iter(lambda: f.read(READ_BLOCK_BYTES), b""):
            scan, remaining = 0, block.count(b"\n")
            while True:
                boundary = (n // every + 1) * every  # the line whose end starts the next segment
                if (limit and boundary >= limit) or n + remaining < boundary:
                    n += remaining
                    break
                at = scan - 1
                for _ in range(boundary - n):
                    at = block.find(b"\n", at + 1)
                starts.append(pos + at + 1)
                remaining -= boundary - n
                n, scan = boundary, at + 1
            pos += len(block)
            last = block[-1:]
    return starts, n + int(pos > 0 and last != b"\n")


def segment_offsets(src_uri: str, tgt_uri: str, segment_lines: int, max_lines: int = 0) -> tuple[list[Segment], int]:
    """Cut an aligned file pair into segments of ``segment_lines`` lines (the last shorter), covering
    the first ``max_lines`` lines (0 = all); also returns the line count. Both files are read to
    the end, so misaligned files raise ``DataError`` here as in ``read_pair_chunks``. The cut
    depends only on the files and ``segment_lines``: the same on any machine or cluster size."""
    src_starts, n_src = _line_starts(src_uri, segment_lines, max_lines)
    tgt_starts, n_tgt = _line_starts(tgt_uri, segment_lines, max_lines)
    if n_src != n_tgt:
        raise _misaligned(src_uri, n_src, tgt_uri, n_tgt)
    covered = min(n_src, max_lines) if max_lines else n_src
    segments = [Segment(i * segment_lines + 1, min(segment_lines, covered - i * segment_lines), s, t)
                for i, (s, t) in enumerate(zip(src_starts, tgt_starts)) if covered > i * segment_lines]
    return segments, n_src


def read_pair_chunks(corpus: str, src_uri: str, tgt_uri: str, chunk_lines: int, max_lines: int = 0,
                     strict_utf8: bool = False, report: ReadReport | None = None,
                     segment: Segment | None = None) -> Iterator[pa.Table]:
    """Aligned (src, tgt) lines as tables of ``TEXT_SCHEMA``, ``chunk_lines`` rows at a time.

    ``max_lines`` > 0 keeps only the first lines, but both files are still read to the end so
    that misaligned files are always caught: different line counts raise ``DataError`` naming
    both files and both counts. With ``segment`` only its lines are read (``segment_offsets``
    checked the alignment already) and ``line`` numbers continue from ``segment.first_line``.
    """
    if segment is not None:
        yield from _segment_chunks(corpus, src_uri, tgt_uri, chunk_lines, segment, strict_utf8, report)
        return
    report = report if report is not None else ReadReport()
    src_it, tgt_it = file_lines(src_uri), file_lines(tgt_uri)
    n = 0
    src_buf: list[bytes] = []
    tgt_buf: list[bytes] = []

    def flush() -> pa.Table:
        first = n - len(src_buf) + 1
        table = pa.table({
            "corpus": pa.array([corpus] * len(src_buf), pa.string()),
            "line": pa.array(np.arange(first, first + len(src_buf), dtype=np.int64)),
            "src": _decode(src_buf, src_uri, first, strict_utf8, report),
            "tgt": _decode(tgt_buf, tgt_uri, first, strict_utf8, report),
        }, schema=TEXT_SCHEMA)
        src_buf.clear()
        tgt_buf.clear()
        return table

    for s in src_it:
        t = next(tgt_it, None)
        if t is None:
            raise _misaligned(src_uri, n + 1 + sum(1 for _ in src_it), tgt_uri, n)
        n += 1
        if max_lines and n > max_lines:
            continue  # only counting now
        src_buf.append(s)
        tgt_buf.append(t)
        if len(src_buf) >= chunk_lines:
            yield flush()
    extra_tgt = sum(1 for _ in tgt_it)
    if extra_tgt:
        raise _misaligned(src_uri, n, tgt_uri, n + extra_tgt)
    if src_buf:
        yield flush()
    report.num_lines = n


def _segment_chunks(corpus: str, src_uri: str, tgt_uri: str, chunk_lines: int, seg: Segment, strict_utf8: bool,
                    report: ReadReport | None) -> Iterator[pa.Table]:
    report = report if report is not None else ReadReport()
    src_it = itertools.islice(byte_lines(src_uri, seg.src_offset), seg.num_lines)
    tgt_it = itertools.islice(byte_lines(tgt_uri, seg.tgt_offset), seg.num_lines)
    first = seg.first_line
    while True:
        src_buf, tgt_buf = list(itertools.islice(src_it, chunk_lines)), list(itertools.islice(tgt_it, chunk_lines))
        if len(src_buf) != len(tgt_buf):  # the files changed since segment_offsets read them
            raise _misaligned(src_uri, first + len(src_buf) - 1, tgt_uri, first + len(tgt_buf) - 1)
        if not src_buf:
            break
        yield pa.table({
            "corpus": pa.array([corpus] * len(src_buf), pa.string()),
            "line": pa.array(np.arange(first, first + len(src_buf), dtype=np.int64)),
            "src": _decode(src_buf, src_uri, first, strict_utf8, report),
            "tgt": _decode(tgt_buf, tgt_uri, first, strict_utf8, report),
        }, schema=TEXT_SCHEMA)
        first += len(src_buf)
    report.num_lines = seg.num_lines


def _misaligned(src_uri: str, n_src: int, tgt_uri: str, n_tgt: int) -> DataError:
    return DataError(f"misaligned corpus: {src_uri} has {n_src} lines but {tgt_uri} has {n_tgt}")


def rule_masks(table: pa.Table, max_words: int, max_length_ratio: float) -> dict[str, np.ndarray]:
    """One boolean mask per rule (before precedence), on the ``src``/``tgt`` columns as they are."""
    src, tgt = table.column("src"), table.column("tgt")
    words_src = pc.count_substring_regex(src, WORD).to_numpy(zero_copy_only=False)
    words_tgt = pc.count_substring_regex(tgt, WORD).to_numpy(zero_copy_only=False)
    invalid = pc.or_(pc.match_substring_regex(src, INVALID_CHARS), pc.match_substring_regex(tgt, INVALID_CHARS))
    shorter = np.minimum(words_src, words_tgt)
    longer = np.maximum(words_src, words_tgt)
    return {
        "invalid_text": invalid.to_numpy(zero_copy_only=False),
        "empty": shorter == 0,
        "too_long": longer > max_words,
        "length_ratio": longer > max_length_ratio * np.maximum(shorter, 1),
    }


def clean_batch(table: pa.Table, max_words: int, max_length_ratio: float,
                drop: bool = True) -> tuple[pa.Table, dict[str, int]]:
    """Apply the rules (in ``RULES`` order) to a ``TEXT_SCHEMA`` table: (kept rows, count per rule).

    With ``drop`` (train, dev) both sides are whitespace-trimmed and the pairs a rule hits are
    removed. Without it (test) the table comes back unchanged and the counts only flag lines.
    """
    if drop:
        table = table.set_column(2, "src", pc.utf8_trim_whitespace(table.column("src")))
        table = table.set_column(3, "tgt", pc.utf8_trim_whitespace(table.column("tgt")))
    masks = rule_masks(table, max_words, max_length_ratio)
    taken = np.zeros(table.num_rows, dtype=bool)
    counts: dict[str, int] = {}
    for rule, mask in masks.items():
        hit = mask & ~taken
        counts[rule] = int(hit.sum())
        taken |= hit
    if not drop:
        return table, counts
    return table.filter(pa.array(~taken)), counts


def pair_hashes(table: pa.Table) -> np.ndarray:
    """A 64-bit hash per (src, tgt) pair; pandas' SipHash with its fixed key, so stable across runs."""
    import pandas as pd

    df = table.select(["src", "tgt"]).to_pandas()
    return pd.util.hash_pandas_object(df, index=False).to_numpy(dtype=np.uint64)
