"""The gRPC health service (``grpc.health.v1.Health``) of every Bagpipe server, answered on its event loop.

``grpc_health``'s own servicer is synchronous: an aio server runs each of its calls in the event loop's
default executor, and every open ``Watch`` stream holds one of those threads for as long as the client
keeps it open. The same few threads run the services' own blocking work (``asyncio.to_thread``: batch
generation, snapshot writes, Redis calls), so a handful of watchers, who need no secret, stalled the job.
Here ``Check`` and ``Watch`` are coroutines on the loop: a watcher costs one small task waiting on an
event, and the number of watchers is bounded (``MAX_WATCHERS``; more are refused RESOURCE_EXHAUSTED) so
that they cannot fill the server's bound on concurrent calls either.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

MAX_WATCHERS = 256
Status = health_pb2.HealthCheckResponse


class HealthService(health_pb2_grpc.HealthServicer):
    """The status of each named service ("" for the server as a whole); ``set`` and
    ``enter_graceful_shutdown`` are called on the server's event loop."""

    def __init__(self, max_watchers: int = MAX_WATCHERS) -> None:
        self._status: dict[str, int] = {}
        self._changed = asyncio.Event()
        self._shutting_down = False
        self._watchers = 0
        self.max_watchers = max_watchers

    def set(self, service: str, status: int) -> None:
        if self._shutting_down:
            return
        self._status[service] = status
        self._notify()

    def enter_graceful_shutdown(self) -> None:
        """Every service reads NOT_SERVING from now on, for good (the server is stopping)."""
        for service in self._status:
            self._status[service] = Status.NOT_SERVING
        self._shutting_down = True
        self._notify()

    def _notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def Check(  # noqa: N802
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        status = self._status.get(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"service {request.service!r} is not served here")
        return Status(status=status)

    async def Watch(  # noqa: N802
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[health_pb2.HealthCheckResponse]:
        if self._watchers >= self.max_watchers:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self._watchers} health watchers already; this server takes at most {self.max_watchers}",
            )
        self._watchers += 1
        try:
            last = None
            while True:
                changed = self._changed  # (taken before the status is read: no change can slip between)
                status = self._status.get(request.service, Status.SERVICE_UNKNOWN)
                if status != last:
                    yield Status(status=status)
                    last = status
                await changed.wait()
        finally:
            self._watchers -= 1
