"""A trainer's failures that a restart would meet again, told apart from those it may not.

A failure is *deterministic* when training the same batches from the same checkpoint meets it again: an
embedding server refuses a row written back (beyond ``--max-abs-value``, or not finite), the loss is not
finite, or the model cannot take a batch (a shape it does not accept). The trainer reports such a failure
to the controller (``errors.TRAINING_FAULT``: its cause and what to change), which fails the job at once,
as it does for bad data: recovering would only replay the same batches into it ``--max-restarts`` times.
Anything else (a peer gone, a server restarting, a collective timing out) is recovered from as any failure is.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterator
from contextlib import contextmanager

import grpc
import torch

from bagpipe.control.generation import Generation
from bagpipe.control.registry import Registry
from bagpipe.core.schema import schema_of
from bagpipe.errors import TRAINING_FAULT
from bagpipe.trainer.config import TrainerConfig

logger = logging.getLogger(__name__)

# an embedding server's refusal of a value written back (shard_store.check_values)
REFUSED_VALUE = re.compile(r"(rows|state): key \d+: value ")


class Deterministic(Exception):
    """A failure that training the same batches again would meet; its message says what to change."""


def describe(error: BaseException) -> str:
    """One line for ``error``: a gRPC error's code and details (not its multi-line repr), else its type and
    first line."""
    if isinstance(error, grpc.RpcError):
        return f"{error.code().name}: {error.details()}"
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


def divergence_advice(config: TrainerConfig) -> str:
    """What to change when the model diverged: the learning rate, and the dense columns that enter the model
    as they are (``transform: none``), if the schema has any."""
    advice = f"lower --lr (now {config.optimizer.lr:g})"
    try:
        raw = [c.name for c in schema_of(config.data, config.schema).dense if c.transform == "none"]
    except (ValueError, OSError):  # (the data's schema cannot be read again: the rate alone)
        raw = []
    if raw:
        shown = ", ".join(raw[:8]) + (f" and {len(raw) - 8} more" if len(raw) > 8 else "")
        advice += f", or give the dense columns taken as they are ({shown}) transform: log1p in a --schema"
    return advice


def deterministic(error: BaseException, config: TrainerConfig) -> str | None:
    """The one-line cause and remedy if ``error`` (or an error it was raised from) is deterministic, else
    None."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, Deterministic):
            return str(seen)
        if (
            isinstance(seen, grpc.RpcError)
            and seen.code() == grpc.StatusCode.INVALID_ARGUMENT
            and REFUSED_VALUE.match(seen.details() or "")
        ):
            return (
                f"the model diverged: an embedding server refused a row written back: {seen.details()}; "
                f"{divergence_advice(config)}"
            )
        seen = seen.__cause__ or seen.__context__
    return None


def finite_loss(batch: int, loss: torch.Tensor, config: TrainerConfig) -> float:
    """``loss`` as a number; Deterministic if it is not finite (the model diverged)."""
    value = float(loss)
    if not math.isfinite(value):
        raise Deterministic(
            f"batch {batch}: the model diverged: the loss is {value}; {divergence_advice(config)}"
        )
    return value


@contextmanager
def model_step(batch: int) -> Iterator[None]:
    """Around the model's forward and backward on ``batch``: an error there is the model's with this batch
    (a shape it does not take), and comes again on a replay. Running out of memory is not counted: what
    else holds the device may change."""
    try:
        yield
    except torch.OutOfMemoryError:
        raise
    except (RuntimeError, ValueError, TypeError, IndexError) as e:
        raise Deterministic(
            f"batch {batch}: the model cannot take the batch ({describe(e)}); check --model and its sizes "
            "against the data's dense and categorical columns"
        ) from e


def report(registry: Registry, generation: Generation, rank: int, cause: str) -> None:
    """Tells the controller that ``trainer/<rank>`` met ``cause``: it fails the job at once."""
    try:
        registry.report(generation.id, f"trainer/{rank}", TRAINING_FAULT + cause)
    except Exception as e:  # (Redis gone too: the failure is then recovered from as any other, and logged)
        logger.warning("could not report the failure to the controller: %s", e)
