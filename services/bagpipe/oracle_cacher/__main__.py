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


async def serve(cfg: OracleConfig) -> None:
    oracle = Oracle(cfg)
    server, port, control, health = await create_server(oracle, cfg.address)
    registry = Registry(cfg.redis_url, cfg.job)
    members = await asyncio.to_thread(registry.wait_for_members, "data_processor", cfg.data_processors)
    addresses = [members[k] for k in sorted(members, key=int)][: cfg.data_processors]
    tasks = oracle.start(addresses)
    registry.register("oracle_cacher", "0", control.address)
    logger.info("oracle on %s: L=%d, %d trainers, %d data processors", control.address, cfg.lookahead, cfg.trainers, len(addresses))
    await control.stop.wait()
    registry.unregister("oracle_cacher", "0")
    for task in tasks:
        task.cancel()
    await serving.stop_gracefully(server, health)


def main(argv: list[str] | None = None) -> None:
    cfg, args = parse(argv)
    serving.configure_logging(args.log_level)
    asyncio.run(serve(cfg))


if __name__ == "__main__":
    main(sys.argv[1:])
