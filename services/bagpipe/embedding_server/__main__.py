"""``python -m bagpipe.embedding_server``: serve one shard until told to stop."""

from __future__ import annotations

import asyncio
import logging
import sys

from bagpipe import allocator, cpu_priority, serving
from bagpipe.control.registry import Registry
from bagpipe.core import snapshots
from bagpipe.core.data import table_offsets
from bagpipe.core.shard_map import ShardMap
from bagpipe.core.shard_store import ShardStore
from bagpipe.embedding_server.config import EmbeddingServerConfig, parse
from bagpipe.embedding_server.resharder import Resharder
from bagpipe.embedding_server.server import create_server

logger = logging.getLogger("bagpipe.embedding_server")


async def serve(cfg: EmbeddingServerConfig) -> None:
    registry = Registry(cfg.coordination.redis_url, cfg.coordination.job)
    http = serving.start_metrics(
        cfg.coordination.metrics_address,
        "embedding_server",
        str(cfg.shard),
        registry,
        None,
        cfg.coordination.advertise_host,
    )
    offsets = table_offsets(cfg.table_rows)
    registry.set_leaving(cfg.shard, False)  # a server that (re)joins is wanted
    shard_map = registry.publish_shard_map(ShardMap.create(int(offsets[-1]), cfg.initial_shards))
    if shard_map.num_keys != int(offsets[-1]):
        raise SystemExit(
            f"shard map in Redis has {shard_map.num_keys} keys, this server's tables {int(offsets[-1])}: "
            "other --table-rows than the job's?"
        )
    width = cfg.optimizer.state_width(cfg.row_width)
    store = ShardStore(shard_map, cfg.shard, offsets, cfg.row_width, width, cfg.seed)
    store.non_negative = cfg.optimizer.non_negative_columns(cfg.row_width)
    if cfg.init_from:
        from bagpipe.core import checkpoint  # (loads torch, which the server needs for nothing else)

        ckpt = checkpoint.load(cfg.init_from)
        try:
            store.load_checkpoint(ckpt, cfg.optimizer.state_keys, cfg.embedding_dim, cfg.linear)
        except ValueError as e:
            raise SystemExit(f"--init-from {cfg.init_from}: {e}") from None
    if cfg.resume_batch:
        assert cfg.checkpoint_dir is not None
        try:
            files = snapshots.files_of(cfg.checkpoint_dir, cfg.resume_batch)
            restored = store.restore(snapshots.row_deltas(cfg.checkpoint_dir, cfg.resume_batch))
        except snapshots.BrokenChain as e:
            raise SystemExit(f"--resume-batch {cfg.resume_batch}: {e}") from None
        logger.info(
            "shard %d: restored %d rows of checkpoint %d from %d files",
            cfg.shard,
            restored,
            cfg.resume_batch,
            len(files),
        )
    store.max_abs = cfg.max_abs_value
    store.warm_up()
    server, port, control, health = await create_server(
        store, cfg.address, cfg.max_rows_per_request, cfg.lookup_threads
    )
    control.address = serving.advertised(control.address, cfg.coordination.advertise_host)
    serving.stop_on_signals(control.stop)  # (before it registers: see stop_on_signals)
    registry.register("embedding_server", str(cfg.shard), control.address)
    http.ready.set()
    logger.info(
        "shard %d serving %d rows of shard map version %d on %s",
        cfg.shard,
        store.rows_held,
        shard_map.version,
        control.address,
    )
    coordinator = None
    fatal: list[BaseException] = []
    if cfg.shard == 0:  # the re-sharding coordinator (shard 0 is the last a StatefulSet removes)

        async def stop_on(error: BaseException) -> None:
            fatal.append(error)
            control.stop.set()

        resharder = Resharder(registry, cfg.migration_rows_per_second)
        coordinator = asyncio.create_task(resharder.run(control.stop, stop_on), name="resharder")
    await control.stop.wait()
    if coordinator is not None:
        await coordinator
    try:
        registry.unregister("embedding_server", str(cfg.shard))
    finally:  # (the server stops even when Redis is gone)
        await serving.stop_gracefully(server, health)
        http.stop()
    if fatal:
        raise SystemExit(
            f"re-sharding failed between two shard-map versions ({fatal[0]}): "
            "the job must roll back to its last checkpoint"
        )


def main(argv: list[str] | None = None) -> None:
    cfg = parse(argv)
    serving.configure_logging(cfg.coordination.log_level)
    said = cpu_priority.apply(cfg.cpu_priority)  # (before gRPC starts its threads: they inherit it)
    failed = cfg.cpu_priority == "idle" and cpu_priority.policy_of(0) != "idle"
    (logger.warning if failed else logger.info)("%s", said)
    allocator.keep_freed_buffers()
    serving.run_service(lambda: asyncio.run(serve(cfg)), "bagpipe.embedding_server")


if __name__ == "__main__":
    main(sys.argv[1:])
