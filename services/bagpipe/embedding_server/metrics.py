"""Prometheus metrics of the embedding server (the one place their names are defined)."""

from prometheus_client import Counter, Gauge, Histogram

REQUESTS = Counter("bagpipe_embedding_server_requests_total", "RPCs served", ["op"])
ROWS = Counter("bagpipe_embedding_server_rows_total", "Rows looked up or written back", ["op"])
LATENCY = Histogram("bagpipe_embedding_server_request_seconds", "Time to serve one RPC", ["op"])
ROWS_HELD = Gauge("bagpipe_embedding_server_rows_held", "Rows stored on this shard")
