"""``python -m bagpipe.data_processor``: serve batches until told to stop."""

from __future__ import annotations

import asyncio
import logging
import sys

from bagpipe import serving
from bagpipe.control.registry import Registry
from bagpipe.data_processor.config import DataProcessorConfig, parse
from bagpipe.data_processor.server import create_server

logger = logging.getLogger("bagpipe.data_processor")


async def serve(cfg: DataProcessorConfig, metrics_address: str) -> None:
    registry = Registry(cfg.redis_url, cfg.job)
    http = serving.start_metrics(metrics_address, "data_processor", str(cfg.index), registry)
    server, port, control, health = await create_server(cfg, cfg.address)
    registry.register("data_processor", str(cfg.index), control.address)
    http.ready.set()
    logger.info("data processor %d serving %s on %s", cfg.index, cfg.source.data, control.address)
    await control.stop.wait()
    registry.unregister("data_processor", str(cfg.index))
    await serving.stop_gracefully(server, health)
    http.stop()


def main(argv: list[str] | None = None) -> None:
    cfg, args = parse(argv)
    serving.configure_logging(args.log_level)
    asyncio.run(serve(cfg, args.metrics_address))


if __name__ == "__main__":
    main(sys.argv[1:])
