"""The largest request each EmbeddingServer method can legitimately carry (``security.ServerGuard``).

A cap is derived from the shard it serves: keys are int64, and a row travels with its optimizer state as
float32. Requests are refused above their cap before they are decoded, and the server's message limit
is the largest cap, so gRPC itself refuses anything larger from the message's length prefix.
"""

from __future__ import annotations

from bagpipe import serving
from bagpipe.embedding_server.client import MAX_ROWS_PER_RPC
from bagpipe.embedding_server.shard_store import ShardStore

ENVELOPE_BYTES = 4 << 10  # the message's own fields and each tensor's dtype and shape
KEY_BYTES = 8
SHARD_MAP_BYTES_PER_BUCKET = 16  # a bucket's owner in a shard map's JSON, with room to spare
ADDRESS_BYTES = 256  # one shard's host:port in PrepareMigration's addresses


def request_caps(store: ShardStore) -> dict[str, int]:
    """Method name -> the largest request it takes, in bytes (methods not named: a small control cap).
    A lookup or write-back carries at most ``MAX_ROWS_PER_RPC`` keys, where clients split them."""
    max_rows = MAX_ROWS_PER_RPC
    row = KEY_BYTES + 4 * (store.dim + store.state_width)
    buckets = store.shard_map.num_buckets
    return {
        "Lookup": max_rows * KEY_BYTES + ENVELOPE_BYTES,
        "WriteBack": max_rows * row + ENVELOPE_BYTES,
        # a migration's chunks, and the last one with the keys written while it ran: at most every key of
        # the tables (a shard handing all its rows to this one), each with its row and a changed key
        "Receive": min(
            serving.MAX_MESSAGE_BYTES, store.shard_map.num_keys * (row + KEY_BYTES) + ENVELOPE_BYTES
        ),
        # the new and the current shard map, and an address per shard (at most one shard a bucket)
        "PrepareMigration": buckets * (2 * SHARD_MAP_BYTES_PER_BUCKET + ADDRESS_BYTES) + ENVELOPE_BYTES,
    }
