"""The gRPC health service (``grpc.health.v1.Health``) of every Bagpipe server, answered on its event loop.

``grpc_health``'s own servicer is synchronous: an aio server runs each of its calls in the event loop's
default executor, and every open ``Watch`` stream holds one of those threads for as long as the client
keeps it open. The same few threads run the services' own blocking work (``asyncio.to_thread``: batch
generation, snapshot writes, Redis calls), so a handful of watchers, who need no secret, stalled the job.
Here ``Check`` and ``Watch`` are coroutines on the loop: a watcher costs one small task waiting on an
event, and the number of watchers is bounded (``MAX_WATCHERS``; more are refused RESOURCE_EXHAUSTED) so
that they cannot fill the server's bound on concurrent calls either.

The bound is small because of what a stranger's watch can hold: its request is never read (``unread``),
so the server buffers as much of it as the stream's receive window admits (``serving.STREAM_WINDOW_BYTES``,
1 MiB) for as long as the watch stays open. 256 such watches held 255 MB of a server; 16 hold 16 MB at
most (``bench/health_watches.py``). The job itself watches nothing, and a kubelet probe is a ``Check``,
which ends at once and is never refused for want of a place.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

MAX_WATCHERS = 16
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

    def unread(self, method: str) -> grpc.RpcMethodHandler:
        """A handler for ``method`` of the health service (``/grpc.health.v1.Health/Check``) that answers
        without reading the request: the status of the server as a whole (the service ""), which is what a
        kubelet probe asks. A stranger's request may be as large as the server's biggest method allows, and
        is never buffered; the call ends at once, so it holds none of the server's calls in progress (a
        watch still counts against ``max_watchers``)."""
        name = method.rsplit("/", 1)[-1]

        async def check(requests: Any, context: grpc.aio.ServicerContext) -> health_pb2.HealthCheckResponse:
            return Status(status=self._status.get("", Status.SERVICE_UNKNOWN))

        async def watch(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            async for reply in self._watch("", context):
                yield reply

        async def other(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"{name}: needs the job's secret")

        if name == "Check":
            return grpc.stream_unary_rpc_method_handler(check, response_serializer=Status.SerializeToString)
        if name == "Watch":
            return grpc.stream_stream_rpc_method_handler(watch, response_serializer=Status.SerializeToString)
        return grpc.stream_unary_rpc_method_handler(other)

    async def List(  # noqa: N802
        self, request: health_pb2.HealthListRequest, context: grpc.aio.ServicerContext
    ) -> health_pb2.HealthListResponse:
        """Every service's status (on the loop: the base class's would run in the default executor)."""
        return health_pb2.HealthListResponse(
            statuses={name: Status(status=status) for name, status in self._status.items()}
        )

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
        async for reply in self._watch(request.service, context):
            yield reply

    async def _watch(
        self, service: str, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[health_pb2.HealthCheckResponse]:
        """The service's status, then each change of it; ends once the server is stopping."""
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
                status = self._status.get(service, Status.SERVICE_UNKNOWN)
                if status != last:
                    yield Status(status=status)
                    last = status
                if self._shutting_down:  # (NOT_SERVING said: the stop need not wait for the watchers)
                    return
                await changed.wait()
        finally:
            self._watchers -= 1
