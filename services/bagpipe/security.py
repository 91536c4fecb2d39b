"""Who may call a job's services, and one place that turns the project's errors into gRPC statuses.

Every RPC of a job carries the job's secret (``BAGPIPE_JOB_SECRET``: ``bagpipe run`` generates one per run,
the chart keeps one in a Secret) as call metadata; ``ServerGuard``, the interceptor of every server, refuses
a call without it (UNAUTHENTICATED) from its metadata alone, before its body is read: a stranger's large
request costs the server the flow-control window of one HTTP/2 stream, not the request. Only the gRPC health
service is open, since kubelet probes cannot send metadata; a stranger's health request is not read either,
but answered the server's own status. Each method also has a size cap, derived by its
service from what the method can legitimately carry (``ServerGuard(caps=...)``): a larger request is
refused (RESOURCE_EXHAUSTED, naming method, size and cap) before it is decoded, and the server's own
message limit is the largest cap, so gRPC refuses anything larger from its length prefix.
Without the variable, authentication is off (a developer's own processes). The guard also maps
``BagpipeError`` raised by a handler to its status code, so no project error surfaces as UNKNOWN.
Clients add the secret through the channels ``serving`` makes.

The Redis password travels the same way (``BAGPIPE_REDIS_PASSWORD``), never on a command line. Mutual
TLS, which proves who is at the other end of a connection, is ``tls.py``.
"""

from __future__ import annotations

import hmac
import os
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from bagpipe.errors import BagpipeError

JOB_SECRET_ENV = "BAGPIPE_JOB_SECRET"
REDIS_PASSWORD_ENV = "BAGPIPE_REDIS_PASSWORD"
SECRET_KEY = "bagpipe-job-secret"
TRAINER_KEY = "bagpipe-trainer"  # call metadata: the token of the trainer process that owns a rank
OPEN_PREFIX = "/grpc.health.v1.Health/"


def job_secret() -> str | None:
    return os.environ.get(JOB_SECRET_ENV) or None


def redis_password() -> str | None:
    return os.environ.get(REDIS_PASSWORD_ENV) or None


def new_secret() -> str:
    return secrets.token_urlsafe(32)


_generation: list[tuple[str, str]] = []


def set_generation(generation: str) -> None:
    """Every later call of this process carries ``generation`` (a trainer's: control/generation.py)."""
    _generation[:] = [("bagpipe-generation", generation)]


def call_metadata() -> list[tuple[str, str]]:
    secret = job_secret()
    return ([(SECRET_KEY, secret)] if secret else []) + _generation


def _authorized(metadata: Any, secret: str) -> bool:
    for key, value in metadata or ():
        if key == SECRET_KEY:
            given = value if isinstance(value, str) else value.decode(errors="replace")
            return hmac.compare_digest(given.encode(), secret.encode())
    return False


Fence = Callable[[Any], "str | None"]
_fence: Fence | None = None
CONTROL_PREFIX = "/bagpipe.v1.Control/"  # (the launcher's and the controller's calls: never fenced)


def set_fence(fence: Fence | None) -> None:
    """Every later call of this process's server (but health and Control) is first shown to ``fence``, with
    its call metadata; a reason it returns refuses the call with FAILED_PRECONDITION. A service follows
    the job's generations with it (control/generation.py): it refuses trainers until it holds the
    generation's state, and those of a generation that is over."""
    global _fence
    _fence = fence


SMALL_REQUEST_BYTES = 64 << 10  # the cap of a method its service names no cap for (control messages)
UNAUTHENTICATED = "the job's secret is missing or wrong (metadata bagpipe-job-secret)"


class ServerGuard(grpc.aio.ServerInterceptor):
    """Authentication, per-method size caps and error mapping for every handler of one aio server.
    ``caps`` maps a method's name (``WriteBack``) to the largest request it accepts, in bytes; a method
    not named gets ``SMALL_REQUEST_BYTES``."""

    def __init__(self, secret: str | None = None, caps: dict[str, int] | None = None) -> None:
        self.secret = secret if secret is not None else job_secret()
        self.caps = dict(caps or {})
        # the health service's handler, for a method, that answers without reading the request (the
        # server's HealthService.unread); None: strangers' health requests are read like the job's
        self.open_health: Callable[[str], grpc.RpcMethodHandler] | None = None

    def cap(self, method: str) -> int:
        return self.caps.get(method.rsplit("/", 1)[-1], SMALL_REQUEST_BYTES)

    @property
    def largest_cap(self) -> int:
        return max([SMALL_REQUEST_BYTES, *self.caps.values()])

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:
            return handler
        stranger = self.secret is not None and not _authorized(details.invocation_metadata, self.secret)
        if details.method.startswith(OPEN_PREFIX):
            # health is open (kubelet probes send no metadata), but a stranger's request is never read: it
            # is answered the server's own status, whichever service it names
            return self.open_health(details.method) if stranger and self.open_health else handler
        if stranger:
            return _refuse_unread(handler)
        fenced = not details.method.startswith(CONTROL_PREFIX)
        return _wrap(handler, details.method, self.cap(details.method), fenced)


def _refuse_unread(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler that refuses the call without reading its request. The server reads a unary request in
    full before it calls the handler, so the refusal is served as a request-streaming method, which gRPC
    calls at once with an iterator it never pulls from; the wire format is the same, so the client
    cannot tell, and the unread bytes are dropped with the stream."""

    async def refuse(requests: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED)

    async def refuse_stream(requests: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED)
        yield  # (an async generator: the reply of a server-streaming method)

    if handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse_stream)
    return grpc.stream_unary_rpc_method_handler(refuse)


class _Undecodable:
    """Bytes that are not the method's request message (answered INVALID_ARGUMENT, not UNKNOWN)."""


class _TooLarge:
    """A request over its method's cap, refused undecoded (RESOURCE_EXHAUSTED)."""

    def __init__(self, message: str) -> None:
        self.message = message


def _decoder(decode: Any, method: str, cap: int) -> Any:
    if decode is None:
        return None

    def safe(data: bytes) -> Any:
        if len(data) > cap:
            return _TooLarge(f"{method}: a request of {len(data)} bytes; this method takes at most {cap}")
        try:
            return decode(data)
        except Exception:
            return _Undecodable()

    return safe


async def _admit(request: Any, context: grpc.aio.ServicerContext, fenced: bool = False) -> None:
    if isinstance(request, _TooLarge):
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, request.message)
    if isinstance(request, _Undecodable):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request: not a valid message for this method")
    if fenced and _fence is not None:
        refused = _fence(context.invocation_metadata())
        if refused is not None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, refused)


def _wrap(handler: grpc.RpcMethodHandler, method: str, cap: int, fenced: bool) -> grpc.RpcMethodHandler:
    decode = _decoder(handler.request_deserializer, method, cap)
    encode = handler.response_serializer
    if handler.unary_unary is not None:
        inner = handler.unary_unary

        async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await _admit(request, context, fenced)
            try:
                return await inner(request, context)
            except BagpipeError as e:
                await context.abort(e.code, str(e))

        return grpc.unary_unary_rpc_method_handler(
            unary, request_deserializer=decode, response_serializer=encode
        )
    if handler.unary_stream is not None:
        inner_stream = handler.unary_stream

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await _admit(request, context, fenced)
            try:
                async for item in inner_stream(request, context):
                    yield item
            except BagpipeError as e:
                await context.abort(e.code, str(e))

        return grpc.unary_stream_rpc_method_handler(
            stream, request_deserializer=decode, response_serializer=encode
        )
    return handler  # (no streaming-request methods in the project's protos)


class _SecretCalls(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
):
    """Adds the job's secret to every call of a blocking channel."""

    def _details(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        return _CallDetails(details, call_metadata())

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)


class _AioSecretUnary(grpc.aio.UnaryUnaryClientInterceptor):
    """The same for an aio channel (one class per kind of call: aio files an interceptor under one kind)."""

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(_AioCallDetails(details, call_metadata()), request)


class _AioSecretStream(grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(_AioCallDetails(details, call_metadata()), request)


def _merged(metadata: Any, extra: list[tuple[str, str]]) -> Any:
    return [*(metadata or ()), *extra] if extra else metadata


class _CallDetails(grpc.ClientCallDetails):
    def __init__(self, base: Any, extra: list[tuple[str, str]]) -> None:
        self.method = base.method
        self.timeout = base.timeout
        self.metadata = _merged(base.metadata, extra)
        self.credentials = base.credentials
        self.wait_for_ready = base.wait_for_ready
        self.compression = base.compression


def _AioCallDetails(base: Any, extra: list[tuple[str, str]]) -> grpc.aio.ClientCallDetails:  # noqa: N802
    return grpc.aio.ClientCallDetails(
        base.method, base.timeout, _merged(base.metadata, extra), base.credentials, base.wait_for_ready
    )


def secure(channel: grpc.Channel) -> grpc.Channel:
    """A blocking channel whose calls carry the job's secret."""
    return grpc.intercept_channel(channel, _SecretCalls())


def aio_interceptors() -> list[Any]:
    return [_AioSecretUnary(), _AioSecretStream()]
