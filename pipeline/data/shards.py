"""Deterministic Parquet shards for ``prepare`` and ``encode``.

A split is written as ``part-SSSSS-of-NNNNN.parquet``; the row with ``idx`` i goes to shard
``i % N``, in ``idx`` order inside each shard. Rows are buffered per shard and written in row
groups of exactly ``ROWS_PER_GROUP`` rows (the last one shorter), so a file's bytes depend only on
its rows, never on how the stream was batched on the way: same rows -> byte-identical shards.
Round-robin keeps the shards balanced and each one a uniform sample of every corpus, which is
what per-worker sharding in training wants; readers that need split order sort by ``idx``.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline import storage
from pipeline.storage import shard_uris  # noqa: F401 (re-exported: a split's listing lives in the core)

ROWS_PER_GROUP = 16_384
COMPRESSION = "zstd"


def shard_name(shard: int, num_shards: int) -> str:
    return f"part-{shard:05d}-of-{num_shards:05d}.parquet"


class ShardWriter:
    """Routes rows to ``num_shards`` Parquet files by ``idx % num_shards``."""

    def __init__(self, dir_uri: str, num_shards: int, schema: pa.Schema, rows_per_group: int = ROWS_PER_GROUP):
        self.dir_uri, self.num_shards, self.schema, self.rows_per_group = dir_uri, num_shards, schema, rows_per_group
        self.fs, self.base = storage.resolve(dir_uri)
        if not storage.is_remote(dir_uri):  # object stores have no folders (only marker objects)
            self.fs.create_dir(self.base, recursive=True)
        self.writers: list[pq.ParquetWriter | None] = [None] * num_shards
        self.buffers: list[list[pa.Table]] = [[] for _ in range(num_shards)]
        self.buffered = [0] * num_shards
        self.num_rows = 0

    def write(self, table: pa.Table) -> None:
        """Append rows (any batch size); ``idx`` must increase across calls."""
        table = table.select(self.schema.names).cast(self.schema)
        self.num_rows += table.num_rows
        shard_of = table.column("idx").to_numpy() % self.num_shards
        for s in range(self.num_shards):
            part = table.filter(pa.array(shard_of == s)) if self.num_shards > 1 else table
            if part.num_rows:
                self.buffers[s].append(part)
                self.buffered[s] += part.num_rows
                while self.buffered[s] >= self.rows_per_group:
                    self._flush(s, self.rows_per_group)

    def _writer(self, s: int) -> pq.ParquetWriter:
        if self.writers[s] is None:
            path = f"{self.base}/{shard_name(s, self.num_shards)}"
            self.writers[s] = pq.ParquetWriter(path, self.schema, filesystem=self.fs, compression=COMPRESSION)
        return self.writers[s]

    def _flush(self, s: int, num_rows: int) -> None:
        buffered = pa.concat_tables(self.buffers[s]).combine_chunks()
        self._writer(s).write_table(buffered.slice(0, num_rows), row_group_size=num_rows)
        rest = buffered.slice(num_rows)
        self.buffers[s] = [rest] if rest.num_rows else []
        self.buffered[s] = rest.num_rows

    def close(self) -> list[str]:
        """Flush the tails; every shard exists afterwards (possibly with zero rows)."""
        for s in range(self.num_shards):
            if self.buffered[s]:
                self._flush(s, self.buffered[s])
            self._writer(s).close()
        return [storage.join(self.dir_uri, shard_name(s, self.num_shards)) for s in range(self.num_shards)]
