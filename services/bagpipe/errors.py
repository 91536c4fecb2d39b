"""One error hierarchy for all services; each error knows its gRPC status code.

Handlers raise these; the interceptor every server has (``security.ServerGuard``) turns them into
``context.abort(code, message)``. Messages read ``"<field>: <why>"`` so a caller can tell what was wrong
and where.
"""

from __future__ import annotations

import grpc


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
