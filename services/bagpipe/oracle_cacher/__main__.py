"""``python -m bagpipe.oracle_cacher``: plan the job's batches until told to stop."""

from __future__ import annotations

import asyncio
import logging
import sys

from bagpipe import serving
from bagpipe.control.registry import Registry
from bagpipe.oracle_cacher.config import OracleConfig, parse
from bagpipe.oracle_cacher.server import Oracle, create_server

logger = logging.getLogger("bagpipe.oracle_cacher")


async def serve(cfg: OracleConfig, metrics_address: str) -> None:
    oracle = Oracle(cfg)
    registry = Registry(cfg.redis_url, cfg.job)
    http = serving.start_metrics(metrics_address, "oracle_cacher", "0", registry, lambda: oracle.failure)
    server, port, control, health = await create_server(oracle, cfg.address)
    members = await asyncio.to_thread(registry.wait_for_members, "data_processor", cfg.data_processors)
    addresses = [members[k] for k in sorted(members, key=int)][: cfg.data_processors]
    tasks = oracle.start(addresses)
    registry.register("oracle_cacher", "0", control.address)
    http.ready.set()
    logger.info(
        "oracle on %s: L %s (at most %d), %s cache, %d trainers, %d data processors", control.address,
        cfg.lookahead or "automatic", cfg.window, cfg.cache_mode, cfg.trainers, len(addresses),
    )  # fmt: skip
    await control.stop.wait()
    registry.unregister("oracle_cacher", "0")
    for task in tasks:
        task.cancel()
    await serving.stop_gracefully(server, health)
    http.stop()


def main(argv: list[str] | None = None) -> None:
    cfg, args = parse(argv)
    serving.configure_logging(args.log_level)
    asyncio.run(serve(cfg, args.metrics_address))


if __name__ == "__main__":
    main(sys.argv[1:])
