"""``python -m bagpipe.oracle_cacher``: plan the job's batches until told to stop."""

from __future__ import annotations

import asyncio
import logging
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bagpipe import allocator, security, serving
from bagpipe.control.generation import (
    EXIT_RESTART,
    Follower,
    Generation,
    Membership,
    follow_until_stopped,
)
from bagpipe.control.registry import Registry
from bagpipe.oracle_cacher.config import OracleConfig, parse
from bagpipe.oracle_cacher.server import Rewinding, create_server

logger = logging.getLogger("bagpipe.oracle_cacher")


def _member_order(name: str) -> tuple[int, str]:
    """Data processors by index (local runs) or by pod name (a Deployment in Kubernetes)."""
    return (int(name), "") if name.isdigit() else (1 << 30, name)


PROCESSORS_TIMEOUT_S = 120.0


async def _answers(address: str) -> bool:
    """Whether a server listens at ``address`` and says it is serving."""
    async with serving.aio_channel(address) as ch:
        try:
            reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        except grpc.aio.AioRpcError:
            return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


async def live_processors(registry: Registry, count: int) -> dict[str, str]:
    """``count`` data processors that answer at their registered addresses, the first by
    ``_member_order``, and those addresses. A processor that died leaves its address in Redis until it is
    started again and registers (a container's restart: the same address; a pod replaced: another name):
    a generation that streamed from it would fail at once and cost the job a second recovery."""
    deadline = time.monotonic() + PROCESSORS_TIMEOUT_S
    while True:
        members = await asyncio.to_thread(registry.wait_for_members, "data_processor", count)
        live: dict[str, str] = {}
        for name in sorted(members, key=_member_order):
            if await _answers(members[name]):
                live[name] = members[name]
                if len(live) == count:
                    return live
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{len(live)} of {count} data processors answer at their registered addresses after "
                f"{PROCESSORS_TIMEOUT_S:g} s"
            )
        await asyncio.sleep(0.1)


async def serve(cfg: OracleConfig) -> None:
    registry = Registry(cfg.coordination.redis_url, cfg.coordination.job)
    member = str(cfg.shard)  # (shard I of --oracles K; 0 for the one oracle)
    membership = Membership(registry, "oracle_cacher", member)
    membership.announce()
    servicer = Rewinding(cfg)
    http = serving.start_metrics(
        cfg.coordination.metrics_address,
        "oracle_cacher",
        member,
        registry,
        lambda: servicer.oracle.failure if servicer.tasks else None,
        cfg.coordination.advertise_host,
    )

    async def rewind(generation: Generation) -> str:
        members = await live_processors(registry, cfg.data_processors)
        by_address = {a: k for k, a in members.items()}
        addresses = list(members.values())

        async def blame(address: str, reason: str) -> None:
            """The controller hears which processor failed (a broken stream, bad data), not of trainers
            that only wait for plans."""
            member = f"data_processor/{by_address.get(address, address)}"
            await asyncio.to_thread(registry.report, generation.id, member, reason)

        await servicer.rewind(generation.start_batch, addresses, blame)
        return f"planning from batch {generation.start_batch} ({len(addresses)} data processors)"

    follower = Follower(membership, rewind, "plans nothing before the controller's first generation")
    security.set_fence(follower.refusal)
    server, port, control, health = await create_server(servicer, cfg.address)
    control.address = serving.advertised(control.address, cfg.coordination.advertise_host)
    serving.stop_on_signals(control.stop)  # (before it registers: see stop_on_signals)
    registry.register("oracle_cacher", member, control.address)
    http.ready.set()
    logger.info(
        "oracle%s on %s: L %s (at most %d), %s cache, %d trainers, %d data processors",
        f" shard {cfg.shard} of {cfg.oracles}" if cfg.oracles > 1 else "",
        control.address,
        cfg.lookahead or "automatic",
        cfg.window,
        cfg.cache_mode,
        cfg.trainers,
        cfg.data_processors,
    )
    restart = await follow_until_stopped(follower, control.stop)
    servicer.stop()
    try:
        registry.unregister("oracle_cacher", member)
    finally:  # (the server stops even when Redis is gone)
        await serving.stop_gracefully(server, health)
        http.stop()
    if restart is not None:
        raise SystemExit(EXIT_RESTART)


def main(argv: list[str] | None = None) -> None:
    cfg = parse(argv)
    serving.configure_logging(cfg.coordination.log_level)
    allocator.keep_freed_buffers()
    serving.run_service(lambda: asyncio.run(serve(cfg)), "bagpipe.oracle_cacher")


if __name__ == "__main__":
    main(sys.argv[1:])
