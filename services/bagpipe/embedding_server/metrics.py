"""Prometheus metrics of the embedding server (the one place their names are defined)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

if TYPE_CHECKING:
    from bagpipe.embedding_server.row_tier import RowTier

REQUESTS = Counter("bagpipe_embedding_server_requests_total", "RPCs served", ["op"])
ROWS = Counter("bagpipe_embedding_server_rows_total", "Rows looked up or written back", ["op"])
LATENCY = Histogram(
    "bagpipe_embedding_server_request_seconds",
    "Time to serve one RPC",
    ["op"],
    buckets=(0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0),
)
INITIAL_ROWS = Counter(
    "bagpipe_embedding_server_initial_rows_total",
    "Rows a lookup answered as still initial, by position only (the client computes them)",
)
BYTES = Counter(
    "bagpipe_embedding_server_bytes_total", "Row and optimizer-state bytes served or stored", ["op"]
)
ROWS_HELD = Gauge("bagpipe_embedding_server_rows_held", "Rows stored on this shard")
SNAPSHOT_SECONDS = Histogram(
    "bagpipe_embedding_server_snapshot_seconds",
    "Time to write the changed rows of one checkpoint",
    buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0),
)
SNAPSHOT_ROWS = Counter(
    "bagpipe_embedding_server_snapshot_rows_total", "Changed rows written into checkpoints"
)
SHARD_MAP_VERSION = Gauge(
    "bagpipe_embedding_server_shard_map_version", "Shard-map version this server serves"
)
MIGRATION_TARGET = Gauge(
    "bagpipe_embedding_server_migration_target_version", "Version a migration under way moves to (0: none)"
)
MIGRATED_ROWS = Counter(
    "bagpipe_embedding_server_migrated_rows_total", "Rows sent or received by re-sharding", ["direction"]
)
MIGRATED_BYTES = Counter(
    "bagpipe_embedding_server_migrated_bytes_total",
    "Row and optimizer-state bytes sent or received by re-sharding",
    ["direction"],
)
SWITCH_SECONDS = Histogram(
    "bagpipe_embedding_server_switch_seconds",
    "From the seal of a migration until the new version is served",
    buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0),
)
RESHARDS = Counter(
    "bagpipe_embedding_server_reshards_total", "Re-shardings this coordinator completed (shard 0)"
)
RESHARD_SECONDS = Histogram(
    "bagpipe_embedding_server_reshard_seconds",
    "Time of each phase of a re-sharding (coordinator, shard 0)",
    ["stage"],
    buckets=(0.01, 0.05, 0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0),
)
BUCKETS_MOVED = Counter(
    "bagpipe_embedding_server_buckets_moved_total", "Buckets moved by re-sharding (coordinator)"
)
UNDO_ROWS = Gauge(
    "bagpipe_embedding_server_undo_rows",
    "Rows the undo log holds (their values at the newest checkpoints, for an in-place roll-back)",
)


class TierCollector:
    """The row tier's figures (``--row-memory``), read from the shard served at each scrape: a shard built
    anew (a roll-back, a migration) starts its counters again, as a process started again would."""

    def __init__(self, tier_of: Callable[[], RowTier | None]) -> None:
        self._tier_of = tier_of

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        tier = self._tier_of()
        if tier is None:
            return
        prefix = "bagpipe_embedding_server_tier"
        for name, text, value in (
            ("rows_in_memory", "Rows (with their state) in memory", tier.resident_rows),
            ("memory_rows", "Rows the memory budget holds (--row-memory)", tier.capacity),
            ("rows_on_disk", "Rows whose value lies on disk only or also", tier.log.rows_on_disk),
            ("file_bytes", "Size of the rows' file on disk", tier.log.file_bytes),
            ("read_ahead_batches", "Batches planned ahead whose rows are read in", tier.read_ahead),
        ):
            yield GaugeMetricFamily(f"{prefix}_{name}", text, value=value)
        rows = CounterMetricFamily(f"{prefix}_rows", "Rows moved between memory and disk", labels=["op"])
        stats, log = tier.stats, tier.log.stats
        for op, value in (
            ("prefetched", stats.prefetched_rows),
            ("waited", stats.waited_rows),
            ("evicted", stats.evicted_rows),
            ("written", stats.written_rows),
            ("peeked", stats.peeked_rows),
            ("wasted", stats.wasted_rows),
            ("compacted", log.rows_compacted),
        ):
            rows.add_metric([op], value)
        yield rows
        yield CounterMetricFamily(
            f"{prefix}_fetch_wait_seconds",
            "Time requests spent reading their rows from disk (the rows not in memory when asked for)",
            value=stats.wait_seconds,
        )
        io = CounterMetricFamily(f"{prefix}_disk_bytes", "Bytes read from and written to disk", labels=["op"])
        io.add_metric(["read"], log.bytes_read)
        io.add_metric(["write"], log.bytes_written)
        yield io
