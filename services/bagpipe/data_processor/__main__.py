"""``python -m bagpipe.data_processor``: serve batches until told to stop."""

from __future__ import annotations

import asyncio
import logging
import socket
import sys

from bagpipe import allocator, serving
from bagpipe.control.generation import (
    EXIT_RESTART,
    Follower,
    Generation,
    Membership,
    current,
    follow_until_stopped,
)
from bagpipe.control.registry import Registry
from bagpipe.core.data import DataFormatError
from bagpipe.core.schema import TABLE_KINDS
from bagpipe.data_processor.config import DataProcessorConfig, parse
from bagpipe.data_processor.server import create_server
from bagpipe.errors import BAD_DATA, EXIT_DATA_ERROR

logger = logging.getLogger("bagpipe.data_processor")


async def serve(cfg: DataProcessorConfig) -> None:
    registry = Registry(cfg.coordination.redis_url, cfg.coordination.job)
    # local runs number processors; in a Deployment each pod registers under its own name
    member = str(cfg.index) if cfg.index is not None else socket.gethostname()
    membership = Membership(registry, "data_processor", member)
    membership.announce()

    async def nothing_to_undo(generation: Generation) -> str:
        return "batches are drawn by number: nothing to rewind here"

    # stateless: any generation is this one's; it follows them only to restart once Redis loses it
    follower = Follower(membership, nothing_to_undo, adopt=lambda generation: True)
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
    if cfg.source.data.partition(":")[0] in TABLE_KINDS and not cfg.source.schema:
        logger.info("schema inferred from the first file: %s", cfg.source.layout().describe())
    restart = await follow_until_stopped(follower, control.stop)
    try:
        registry.unregister("data_processor", member)
    finally:  # (the server stops even when Redis is gone)
        await serving.stop_gracefully(server, health)
        http.stop()
    if restart is not None:
        raise SystemExit(EXIT_RESTART)


def _report_bad_data(cfg: DataProcessorConfig, line: str) -> None:
    """Tells the controller, if a job is under way, that this processor's input is bad (the oracle does the
    same for a bad line met later): the job then fails at once naming the line, instead of waiting on a
    processor that starts again and again (a Deployment's pod)."""
    member = str(cfg.index) if cfg.index is not None else socket.gethostname()
    try:
        registry = Registry(cfg.coordination.redis_url, cfg.coordination.job)
        generation = current(registry)
        if generation is not None:
            registry.report(generation.id, f"data_processor/{member}", BAD_DATA + line)
    except Exception as e:  # (Redis may be gone too: the exit status and the line still say it)
        logger.warning("could not report the bad data to the controller: %s", e)


def main(argv: list[str] | None = None) -> None:
    cfg = parse(argv)
    serving.configure_logging(cfg.coordination.log_level)
    try:
        cfg.source.check_head()  # (before it joins the job: its input's first lines parse)
    except DataFormatError as e:
        logger.error("bad data: %s", e)
        _report_bad_data(cfg, str(e))
        print(f"bagpipe data processor: {BAD_DATA}{e}", file=sys.stderr)
        raise SystemExit(EXIT_DATA_ERROR) from None
    allocator.keep_freed_buffers()
    serving.run_service(lambda: asyncio.run(serve(cfg)), "bagpipe.data_processor")


if __name__ == "__main__":
    main(sys.argv[1:])
