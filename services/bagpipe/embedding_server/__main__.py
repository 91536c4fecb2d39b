"""``python -m bagpipe.embedding_server``: serve one shard until told to stop."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from bagpipe import serving
from bagpipe.control.registry import Registry
from bagpipe.core import checkpoint, snapshots
from bagpipe.core.data import table_offsets
from bagpipe.core.optim import OptimizerConfig
from bagpipe.core.shard_map import ShardMap
from bagpipe.core.shard_store import ShardStore
from bagpipe.embedding_server.config import EmbeddingServerConfig, build_parser, parse
from bagpipe.embedding_server.server import create_server

logger = logging.getLogger("bagpipe.embedding_server")


async def serve(cfg: EmbeddingServerConfig, args: argparse.Namespace) -> None:
    registry = Registry(cfg.redis_url, cfg.job)
    http = serving.start_metrics(
        args.metrics_address, "embedding_server", str(cfg.shard), registry, None, args.advertise_host
    )
    offsets = table_offsets(cfg.table_rows)
    shard_map = registry.publish_shard_map(ShardMap.create(int(offsets[-1]), cfg.num_shards))
    if shard_map.num_keys != int(offsets[-1]) or shard_map.num_shards != cfg.num_shards:
        raise SystemExit(
            f"shard map in Redis ({shard_map.num_keys} keys, {shard_map.num_shards} shards) does not match "
            f"this server ({int(offsets[-1])} keys, {cfg.num_shards} shards)"
        )
    width = OptimizerConfig(cfg.optimizer).state_width(cfg.embedding_dim)
    store = ShardStore(shard_map, cfg.shard, offsets, cfg.embedding_dim, width, cfg.seed)
    if cfg.init_from:
        ckpt = checkpoint.load(cfg.init_from)
        store.load_checkpoint(ckpt["embeddings"], (ckpt.get("optimizer") or {}).get("embeddings"))
    if cfg.resume_batch:
        assert cfg.checkpoint_dir is not None
        restored = store.restore(snapshots.row_deltas(cfg.checkpoint_dir, cfg.resume_batch))
        logger.info("shard %d: restored %d rows of checkpoint %d", cfg.shard, restored, cfg.resume_batch)
    server, port, control, health = await create_server(store, cfg.address)
    control.address = serving.advertised(control.address, args.advertise_host)
    registry.register("embedding_server", str(cfg.shard), control.address)
    http.ready.set()
    logger.info("shard %d/%d serving %d rows on %s", cfg.shard, cfg.num_shards, store.rows_held, control.address)
    await control.stop.wait()
    registry.unregister("embedding_server", str(cfg.shard))
    await serving.stop_gracefully(server, health)
    http.stop()


def main(argv: list[str] | None = None) -> None:
    cfg = parse(argv)
    args = build_parser().parse_args(argv)
    serving.configure_logging(args.log_level)
    asyncio.run(serve(cfg, args))


if __name__ == "__main__":
    main(sys.argv[1:])
