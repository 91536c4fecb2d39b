"""Prometheus metrics of the embedding server (the one place their names are defined)."""

from prometheus_client import Counter, Gauge, Histogram

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
