"""The embedding-server service: one shard of every table behind gRPC."""
