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


class BadData(InvalidArgument):
    """The input's fault: a data processor's ``file:line: field ...``, sent as ``data: <that>``."""

    PREFIX = "data: "

    def __init__(self, reason: str) -> None:
        super().__init__("data", reason)


class FailedPrecondition(BagpipeError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class Unavailable(BagpipeError):
    """Worth retrying: what failed may pass (a transient error of a volume, say)."""

    code = grpc.StatusCode.UNAVAILABLE


class PermissionDenied(BagpipeError):
    code = grpc.StatusCode.PERMISSION_DENIED


class NotFound(BagpipeError):
    code = grpc.StatusCode.NOT_FOUND


# A failure report whose reason starts with this is the input's fault (a data processor's ``file:line:
# field ...``): a restart would read the same line again, so the job fails at once, naming it
BAD_DATA = "bad data: "
EXIT_DATA_ERROR = 65  # (sysexits' EX_DATAERR) a data processor whose input's first lines do not parse
# A failure report whose reason starts with this is a trainer's deterministic failure (trainer/faults.py: a
# diverged model, a batch the model cannot take): a restart would replay the same batches into it, so the
# job fails at once, with the cause and what to change
TRAINING_FAULT = "training: "
