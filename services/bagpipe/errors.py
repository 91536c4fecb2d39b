"""One error hierarchy for all services; each error knows its gRPC status code.

Handlers raise these; ``grpc_errors`` turns them into ``context.abort(code, message)``. Messages
read ``"<field>: <why>"`` so a caller can tell what was wrong and where.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import grpc

logger = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])


class BagpipeError(Exception):
    code = grpc.StatusCode.INTERNAL


class InvalidArgument(BagpipeError):
    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


class FailedPrecondition(BagpipeError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class PermissionDenied(BagpipeError):
    code = grpc.StatusCode.PERMISSION_DENIED


class NotFound(BagpipeError):
    code = grpc.StatusCode.NOT_FOUND


def grpc_errors(handler: F) -> F:
    """Decorates an aio servicer method (coroutine or async generator) so a BagpipeError aborts
    the call with its status code instead of surfacing as UNKNOWN."""
    if inspect.isasyncgenfunction(handler):

        @functools.wraps(handler)
        async def stream(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                async for item in handler(self, request, context):
                    yield item
            except BagpipeError as e:
                await context.abort(e.code, str(e))

        return stream  # type: ignore[return-value]

    @functools.wraps(handler)
    async def unary(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await handler(self, request, context)
        except BagpipeError as e:
            await context.abort(e.code, str(e))

    return unary  # type: ignore[return-value]
