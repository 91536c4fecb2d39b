"""Prometheus metrics of the embedding server (the one place their names are defined)."""

from prometheus_client import Counter, Gauge, Histogram

REQUESTS = Counter("bagpipe_embedding_server_requests_total", "RPCs served", ["op"])
ROWS = Counter("bagpipe_embedding_server_rows_total", "Rows looked up or written back", ["op"])
LATENCY = Histogram(
    "bagpipe_embedding_server_request_seconds", "Time to serve one RPC", ["op"],
    buckets=(0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0),
)  # fmt: skip
BYTES = Counter("bagpipe_embedding_server_bytes_total", "Row and optimizer-state bytes served or stored", ["op"])
ROWS_HELD = Gauge("bagpipe_embedding_server_rows_held", "Rows stored on this shard")
SNAPSHOT_SECONDS = Histogram(
    "bagpipe_embedding_server_snapshot_seconds", "Time to write the changed rows of one checkpoint",
    buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0),
)  # fmt: skip
SNAPSHOT_ROWS = Counter("bagpipe_embedding_server_snapshot_rows_total", "Changed rows written into checkpoints")
