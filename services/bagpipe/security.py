"""Who may call a job's services, and one place that turns the project's errors into gRPC statuses.

Every RPC of a job carries the job's secret (``BAGPIPE_JOB_SECRET``: ``bagpipe run`` generates one per run,
the chart keeps one in a Secret) as call metadata; ``ServerGuard``, the interceptor of every server, refuses
a call without it (UNAUTHENTICATED) before any handler runs. Only the gRPC health service is open, since
kubelet probes cannot send metadata. Without the variable, authentication is off (a developer's own
processes). The guard also maps ``BagpipeError`` raised by a handler to its status code, so no project
error surfaces as UNKNOWN. Clients add the secret through the channels ``serving`` makes.

The Redis password travels the same way (``BAGPIPE_REDIS_PASSWORD``), never on a command line.
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


def call_metadata() -> list[tuple[str, str]]:
    secret = job_secret()
    return [(SECRET_KEY, secret)] if secret else []


def _authorized(metadata: Any, secret: str) -> bool:
    for key, value in metadata or ():
        if key == SECRET_KEY:
            given = value if isinstance(value, str) else value.decode(errors="replace")
            return hmac.compare_digest(given.encode(), secret.encode())
    return False


class ServerGuard(grpc.aio.ServerInterceptor):
    """Authentication and error mapping for every handler of one aio server."""

    def __init__(self, secret: str | None = None) -> None:
        self.secret = secret if secret is not None else job_secret()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_PREFIX):
            return handler  # (the health servicer's handlers are synchronous: left as they are)
        denied = self.secret is not None and not _authorized(details.invocation_metadata, self.secret)
        return _wrap(handler, denied)


class _Undecodable:
    """Bytes that are not the method's request message (answered INVALID_ARGUMENT, not UNKNOWN)."""


def _decoder(decode: Any) -> Any:
    if decode is None:
        return None

    def safe(data: bytes) -> Any:
        try:
            return decode(data)
        except Exception:
            return _Undecodable()

    return safe


async def _admit(request: Any, context: grpc.aio.ServicerContext, denied: bool) -> None:
    if denied:
        await context.abort(
            grpc.StatusCode.UNAUTHENTICATED,
            "the job's secret is missing or wrong (metadata bagpipe-job-secret)",
        )
    if isinstance(request, _Undecodable):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request: not a valid message for this method")


def _wrap(handler: grpc.RpcMethodHandler, denied: bool) -> grpc.RpcMethodHandler:
    decode = _decoder(handler.request_deserializer)
    encode = handler.response_serializer
    if handler.unary_unary is not None:
        inner = handler.unary_unary

        async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await _admit(request, context, denied)
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
            await _admit(request, context, denied)
            try:
                async for item in inner_stream(request, context):
                    yield item
            except BagpipeError as e:
                await context.abort(e.code, str(e))

        return grpc.unary_stream_rpc_method_handler(
            stream, request_deserializer=decode, response_serializer=encode
        )
    if denied:  # (no streaming-request methods in the project's protos)

        async def refuse(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await _admit(request, context, denied)

        return grpc.unary_unary_rpc_method_handler(refuse)
    return handler


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
