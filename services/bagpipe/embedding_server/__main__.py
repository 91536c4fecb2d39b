"""``python -m bagpipe.embedding_server``: serve one shard until told to stop."""

from __future__ import annotations

import asyncio
import logging
import shutil
import sys
from pathlib import Path

import prometheus_client

from bagpipe import allocator, cpu_priority, security, serving
from bagpipe.control.generation import EXIT_RESTART, Follower, Generation, Membership, Restart
from bagpipe.control.registry import Registry
from bagpipe.core import snapshots
from bagpipe.core.data import table_offsets
from bagpipe.core.shard_map import ShardMap
from bagpipe.embedding_server import metrics
from bagpipe.embedding_server.config import EmbeddingServerConfig, parse
from bagpipe.embedding_server.resharder import Resharder
from bagpipe.embedding_server.server import EmbeddingServicer, create_server
from bagpipe.embedding_server.shard_store import ShardStore
from bagpipe.embedding_server.tier_feed import follow_fetches

logger = logging.getLogger("bagpipe.embedding_server")


def build_store(cfg: EmbeddingServerConfig, shard_map: ShardMap, batch: int) -> ShardStore:
    """This shard under ``shard_map``, holding checkpoint ``batch``'s rows: the seed's initial rows (or
    ``--init-from``'s), then the checkpoint chain up to ``batch`` (none for 0).

    A shard that holds no rows under ``shard_map`` reads neither: no file has a row of its. That is a
    server joining by a scale-up (every server is started with ``--resume-batch latest``, so that one
    started again after a failure loads the newest checkpoint): its rows come from its peers, when
    re-sharding moves buckets to it. Started again once it holds buckets, it reads the chain like any."""
    offsets = table_offsets(cfg.table_rows)
    width = cfg.optimizer.state_width(cfg.row_width)
    store = ShardStore(shard_map, cfg.shard, offsets, cfg.row_width, width, cfg.seed, tier=cfg.tier)
    store.non_negative = cfg.optimizer.non_negative_columns(cfg.row_width)
    if batch and cfg.checkpoint_dir is None:
        raise SystemExit(f"checkpoint {batch}: this server has no --checkpoint-dir")
    if store.rows_held == 0:
        logger.info(
            "shard %d holds no rows of shard map version %d: nothing to read (its rows come from its peers)",
            cfg.shard,
            shard_map.version,
        )
    else:
        _load(store, cfg, batch)
    store.max_abs = cfg.max_abs_value
    if cfg.checkpoint_dir:  # (without checkpoints a roll-back goes to batch 0: a new shard, no log)
        store.track_undo(batch)
    store.built_batch = batch
    return store


def _load(store: ShardStore, cfg: EmbeddingServerConfig, batch: int) -> None:
    """``--init-from``'s rows of this shard, then those of checkpoint ``batch``'s chain."""
    if cfg.init_from:
        from bagpipe.core import checkpoint  # (loads torch, which the server needs for nothing else)

        try:  # (an interchange checkpoint, or TorchRec DLRM's state dict)
            ckpt = checkpoint.load_init(cfg.init_from, cfg.model, cfg.embedding_dim, cfg.table_rows)
            store.load_checkpoint(ckpt, cfg.optimizer.state_keys, cfg.embedding_dim, cfg.linear)
        except ValueError as e:
            raise SystemExit(f"--init-from {cfg.init_from}: {e}") from None
    if batch:
        assert cfg.checkpoint_dir is not None
        try:
            files = snapshots.files_of(cfg.checkpoint_dir, batch)
            restored = store.restore(snapshots.row_deltas(cfg.checkpoint_dir, batch))
        except snapshots.BrokenChain as e:
            raise SystemExit(f"checkpoint {batch}: {e}") from None
        logger.info(
            "shard %d: restored %d rows of checkpoint %d from %d files",
            cfg.shard,
            restored,
            batch,
            len(files),
        )


async def serve(cfg: EmbeddingServerConfig) -> None:
    registry = Registry(cfg.coordination.redis_url, cfg.coordination.job)
    membership = Membership(registry, "embedding_server", str(cfg.shard))
    membership.announce()  # (first: the controller learns of a restart before the shard is loaded)
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
    if cfg.row_disk:  # (what an earlier process of this shard left there: its rows come from the checkpoints)
        for old in Path(cfg.row_disk).glob(f"shard-{cfg.shard}-v*"):
            shutil.rmtree(old, ignore_errors=True)
    store = build_store(cfg, shard_map, cfg.resume_batch)
    store.warm_up()
    allocator.release_free_memory()  # (the build's buffers: a row tier's budget is what stays resident)
    servicer = EmbeddingServicer(store, cfg.lookup_threads)
    # (its figures, read from the shard served at each scrape: a roll-back or a migration replaces it)
    prometheus_client.REGISTRY.register(metrics.TierCollector(lambda: servicer.store.tier))

    def rebuild(batch: int) -> ShardStore:
        current = registry.shard_map()
        assert current is not None
        built = build_store(cfg, current, batch)
        built.warm_up()
        allocator.release_free_memory()
        return built

    async def roll_back(generation: Generation) -> str:
        current = await asyncio.to_thread(registry.shard_map)
        assert current is not None
        return await servicer.roll_back(generation.start_batch, current.version, rebuild)

    def adopt(generation: Generation) -> bool:
        """A server that holds no buckets (one joining by a scale-up) has no rows to take back."""
        return servicer.store.rows_held == 0

    follower = Follower(
        membership,
        roll_back,
        f"holds checkpoint {cfg.resume_batch}; waiting for the controller to roll the job back to it",
        adopt,
    )
    security.set_fence(follower.refusal)
    servicer.fence = follower.refusal
    server, port, control, health = await create_server(store, cfg.address, cfg.lookup_threads, servicer)
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
    del store  # (the servicer's from now: a roll-back or a migration replaces it, and the old must go)
    coordinator = None
    fatal: list[BaseException] = []

    async def stop_on(error: BaseException) -> None:
        fatal.append(error)
        control.stop.set()

    if cfg.shard == 0:  # the re-sharding coordinator (shard 0 is the last a StatefulSet removes)
        resharder = Resharder(registry, cfg.migration_rows_per_second)
        coordinator = asyncio.create_task(resharder.run(control.stop, stop_on), name="resharder")
    following = asyncio.create_task(follower.run(control.stop), name="generations")
    feeding = None  # (a row tier: the oracle's fetch stream feeds its schedule)
    if cfg.tier is not None:
        feeding = asyncio.create_task(
            follow_fetches(servicer, registry, control.stop, cfg.oracles), name="fetches"
        )

    ended: list[BaseException] = []  # why the generations' follower stopped (a Restart, or a bug)

    def followed(task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            ended.append(task.exception())  # type: ignore[arg-type]
            control.stop.set()

    following.add_done_callback(followed)
    await control.stop.wait()
    following.cancel()
    if feeding is not None:
        await feeding
    if coordinator is not None:
        await coordinator
    try:
        registry.unregister("embedding_server", str(cfg.shard))
    finally:  # (the server stops even when Redis is gone)
        await serving.stop_gracefully(server, health)
        http.stop()
        servicer.store.close()  # (the tier's files)
    if ended and isinstance(ended[0], Restart):
        logger.warning("%s: starting again", ended[0].why)
        raise SystemExit(EXIT_RESTART)
    if ended:
        raise ended[0]
    if fatal:
        raise SystemExit(
            f"re-sharding failed between two shard-map versions ({fatal[0]}): this server starts again "
            "and the controller rolls the job back to its last checkpoint"
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
