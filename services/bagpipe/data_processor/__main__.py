"""``python -m bagpipe.data_processor``: serve batches until told to stop."""

from __future__ import annotations

import asyncio
import logging
import socket
import sys

from bagpipe import allocator, serving
from bagpipe.control.registry import Registry
from bagpipe.data_processor.config import DataProcessorConfig, parse
from bagpipe.data_processor.server import create_server

logger = logging.getLogger("bagpipe.data_processor")


async def serve(cfg: DataProcessorConfig) -> None:
    registry = Registry(cfg.coordination.redis_url, cfg.coordination.job)
    # local runs number processors; in a Deployment each pod registers under its own name
    member = str(cfg.index) if cfg.index is not None else socket.gethostname()
    http = serving.start_metrics(
        cfg.coordination.metrics_address,
        "data_processor",
        member,
        registry,
        None,
        cfg.coordination.advertise_host,
    )
    server, port, control, health = await create_server(cfg, cfg.address)
    control.address = serving.advertised(control.address, cfg.coordination.advertise_host)
    serving.stop_on_signals(control.stop)  # (before it registers: see stop_on_signals)
    registry.register("data_processor", member, control.address)
    http.ready.set()
    logger.info("data processor %s serving %s on %s", member, cfg.source.data, control.address)
    await control.stop.wait()
    try:
        registry.unregister("data_processor", member)
    finally:  # (the server stops even when Redis is gone)
        await serving.stop_gracefully(server, health)
        http.stop()


def main(argv: list[str] | None = None) -> None:
    cfg = parse(argv)
    serving.configure_logging(cfg.coordination.log_level)
    allocator.keep_freed_buffers()
    serving.run_service(lambda: asyncio.run(serve(cfg)), "bagpipe.data_processor")


if __name__ == "__main__":
    main(sys.argv[1:])
