"""How every client of the job calls again: only a server that is restarting (UNAVAILABLE), with backoff.

Shared by the trainers' calls to the embedding servers and to the oracle; ``Moved`` tells a caller that a
server it could not reach is no longer needed by the shard map in force, so it routes the request again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

import grpc

logger = logging.getLogger(__name__)

RETRIES = 5
T = TypeVar("T")


class Moved(Exception):
    """The server did not answer, and a newer shard map than the request's is in force."""


def call_with_retry(
    fn: Callable[[], T],
    what: str,
    moved: Callable[[], bool] | None = None,
    retry: tuple[grpc.StatusCode, ...] = (grpc.StatusCode.UNAVAILABLE,),
) -> T:
    """Retries only UNAVAILABLE (server restarting), with backoff; every call has a deadline. With ``moved``
    (is there a newer shard map?), an unavailable server that the map no longer needs (drained and gone)
    raises ``Moved`` instead, so the caller routes the request again. An idempotent call may name more
    codes to ``retry`` (DEADLINE_EXCEEDED: its reply was lost or late)."""
    for attempt in range(RETRIES):
        try:
            return fn()
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNAVAILABLE and moved is not None and moved():
                raise Moved(what) from e
            if e.code() not in retry or attempt == RETRIES - 1:
                raise
            logger.warning("%s: %s, retrying (%d/%d)", what, e.code().name.lower(), attempt + 1, RETRIES)
            time.sleep(0.1 * 2**attempt)
    raise AssertionError("unreachable")
