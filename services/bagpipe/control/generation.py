"""Generations: how the controller (``bagpipe.controller``) takes every service of a job back to one
checkpoint after a failure, through Redis, without stopping the services that did not fail.

A generation is one stretch of training from a start batch (a complete checkpoint, or 0). Its record in
Redis (``Registry.generation_record``) has an ``id`` (random: a number alone could repeat after Redis
itself is lost), a ``number``, the ``start_batch`` and a ``state``:

* ``rolling_back``: every serving member (embedding servers, the oracle) takes the start batch's state (a
  server undoes the rows changed since the checkpoint, or reloads them; the oracle rewinds its plan) and
  acks the generation with its incarnation;
* ``forming``: every serving member acked; trainers (new processes: survivors of the last generation
  exit with ``EXIT_RESTART`` and are started again, as a kubelet or the local process keeper does) ack
  as ``trainer/<rank>``, then load the checkpoint's dense model and meet in a rendezvous of this
  generation;
* ``training``: every trainer acked; the controller watches for failures;
* ``done`` (every trainer finished) or ``failed`` (the controller gave up; ``reason`` says why).

Every process announces itself (``Membership.announce``) with a fresh incarnation. A member whose
incarnation differs from the one that acked the generation in force was restarted: its state is not the
generation's, so it refuses requests (``FAILED_PRECONDITION``) until a newer generation takes it in, and
the controller starts that generation. A member whose announcement vanished (Redis restarted empty)
exits with ``EXIT_RESTART``: everything it registered is gone, and it comes back as a new process.

Requests of a trainer carry its generation (call metadata ``bagpipe-generation``): a server or oracle
refuses those of another generation, so a trainer of a past generation that has not yet noticed the new
one cannot write into the rolled-back rows.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import redis

from bagpipe.control.registry import Registry

logger = logging.getLogger(__name__)

# "start me again": a member that must rejoin as a new process exits with this (EX_TEMPFAIL); the local
# process keeper and the kubelet restart it, and the chart's trainer Job does not count it as a failure
EXIT_RESTART = 75
METADATA_KEY = "bagpipe-generation"

ROLLING_BACK, FORMING, TRAINING, DONE, FAILED = "rolling_back", "forming", "training", "done", "failed"
POLL_S = 0.1


@dataclass(frozen=True)
class Generation:
    id: str
    number: int
    start_batch: int
    state: str
    reason: str = ""

    @staticmethod
    def of(record: dict[str, str]) -> Generation | None:
        if not record.get("id"):
            return None
        return Generation(
            record["id"],
            int(record.get("number", 0)),
            int(record.get("start_batch", 0)),
            record.get("state", ROLLING_BACK),
            record.get("reason", ""),
        )

    def record(self) -> dict[str, str]:
        return {
            "id": self.id,
            "number": str(self.number),
            "start_batch": str(self.start_batch),
            "state": self.state,
            "reason": self.reason,
            "time": str(time.time()),
        }

    @staticmethod
    def new(number: int, start_batch: int, reason: str) -> Generation:
        return Generation(uuid.uuid4().hex[:12], number, start_batch, ROLLING_BACK, reason)


def current(registry: Registry) -> Generation | None:
    return Generation.of(registry.generation_record())


def where() -> dict[str, Any]:
    """Where this process is: the controller kills a stuck one by pid on this host (``--kill local``) or
    deletes its pod (``--kill kubernetes``; a pod's hostname is its name unless POD_NAME says otherwise)."""
    host = socket.gethostname()
    return {"host": host, "pid": os.getpid(), "pod": os.environ.get("POD_NAME") or host}


class Restart(Exception):
    """This member must start again as a new process: its service stops, then exits with ``EXIT_RESTART``
    (an Exception, not a SystemExit: asyncio lets a SystemExit out of the loop, past the service's own
    stopping)."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


class Membership:
    """One process's identity in its job: ``service/member`` and a fresh incarnation."""

    def __init__(self, registry: Registry, service: str, member: str) -> None:
        self.registry = registry
        self.name = f"{service}/{member}"
        self.incarnation = uuid.uuid4().hex[:12]

    def announce(self) -> None:
        self.registry.announce(self.name, self.incarnation, where())

    def lost(self) -> str | None:
        """Why this process is no longer the member (Redis lost the job's state, or another process took its
        name), or None."""
        now = self.registry.incarnation_of(self.name)
        if now == self.incarnation:
            return None
        if now is None:
            return "its registration is gone from Redis (Redis restarted?)"
        return f"another process registered as {self.name}"


class Follower:
    """A serving member's side of the generations (an embedding server, the oracle): on each new generation
    in ``rolling_back``, ``roll_back`` it (requests are refused meanwhile), ack it, and serve it.

    ``serving`` is the generation this member serves (None: it refuses every request of a trainer)."""

    def __init__(
        self,
        membership: Membership,
        roll_back: Callable[[Generation], Awaitable[str]],
        waiting: str = "starting",
        adopt: Callable[[Generation], bool] | None = None,
    ) -> None:
        self.membership = membership
        self._roll_back = roll_back
        self._adopt = adopt  # whether this member may join a generation under way as it is
        self.serving: str | None = None
        self.acked: str | None = None
        self.waiting = waiting  # what a refused request is told while this member serves no generation

    def refusal(self, metadata: Any) -> str | None:
        """Why a request with call metadata ``metadata`` is refused, or None (``security`` fences with it)."""
        if self.serving is None:
            return f"{self.membership.name} serves no generation yet: {self.waiting}"
        for key, value in metadata or ():
            if key == METADATA_KEY:
                given = value if isinstance(value, str) else value.decode(errors="replace")
                if given != self.serving:
                    return f"generation {given} is over ({self.membership.name} serves {self.serving})"
        return None

    async def run(self, stop: asyncio.Event) -> None:
        """Follows the generations until ``stop``; raises Restart when this member must start again."""
        registry = self.membership.registry
        while not stop.is_set():
            try:
                lost = await asyncio.to_thread(self.membership.lost)
                generation = await asyncio.to_thread(current, registry)
            except redis.RedisError as e:
                logger.warning("%s: Redis: %s", self.membership.name, e)
                lost, generation = None, None
            if lost is not None:
                self.serving = None
                raise Restart(f"{self.membership.name}: {lost}")
            if generation is not None and generation.id != self.acked:
                if generation.state == ROLLING_BACK:
                    self.serving = None
                    self.waiting = f"taking the state of batch {generation.start_batch}"
                    try:
                        said = await self._roll_back(generation)
                        await asyncio.to_thread(
                            registry.ack, generation.id, self.membership.name, self.membership.incarnation
                        )
                    except (redis.RedisError, OSError, TimeoutError) as e:  # (tried again at the next look)
                        logger.warning("%s: generation %d: %s", self.membership.name, generation.number, e)
                    else:
                        self.acked = self.serving = generation.id
                        logger.info(
                            "%s: generation %d from batch %d: %s",
                            self.membership.name,
                            generation.number,
                            generation.start_batch,
                            said,
                        )
                elif self._adopt is not None and self._adopt(generation):
                    await asyncio.to_thread(
                        registry.ack, generation.id, self.membership.name, self.membership.incarnation
                    )
                    self.acked = self.serving = generation.id
                elif self.serving is not None:  # (a generation this member missed: not its state)
                    self.serving = None
                    self.waiting = f"generation {generation.number} began without it"
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), POLL_S)


def join(membership: Membership, rank: int, tick: Callable[[], None] | None = None) -> Generation:
    """(A trainer.) Waits for a generation that is forming and acks it as ``trainer/<rank>``; a generation
    already training went on without this process, which waits for the next."""
    registry = membership.registry
    said = False
    while True:
        lost = membership.lost()
        if lost is not None:
            raise Restart(f"{membership.name}: {lost}")
        generation = current(registry)
        if generation is not None and generation.state == FAILED:
            raise SystemExit(f"{membership.name}: the job failed: {generation.reason}")
        if generation is not None and generation.state == DONE:
            raise SystemExit(0)
        if generation is not None and generation.state == FORMING:
            registry.ack(generation.id, membership.name, membership.incarnation)
            return generation
        if not said:
            logger.info("%s: waiting for the controller's next generation", membership.name)
            said = True
        if tick is not None:
            tick()
        time.sleep(POLL_S)


class Watch:
    """(A trainer.) A thread that calls ``on_change`` once the generation in force is no longer
    ``generation`` (the controller started another: this process must make way) or Redis lost this
    member."""

    def __init__(self, membership: Membership, generation: Generation, on_change: Callable[[str], None]):
        self._membership = membership
        self._generation = generation
        self._on_change = on_change
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="generation-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(POLL_S * 2):
            try:
                lost = self._membership.lost()
                now = current(self._membership.registry)
            except redis.RedisError:
                continue  # (Redis restarting: the announcement tells once it is back)
            if self._stop.is_set():
                return
            if lost is not None:
                self._on_change(lost)
                return
            if now is None or now.id != self._generation.id:
                number = "none" if now is None else str(now.number)
                self._on_change(f"generation {self._generation.number} is over (now {number})")
                return
            if now.state == FAILED:
                self._on_change(f"the job failed: {now.reason}")
                return


async def follow_until_stopped(follower: Follower, stop: asyncio.Event) -> Restart | None:
    """Runs ``follower`` until ``stop`` is set; a Restart it raises sets ``stop`` and is returned (the
    service stops as it would on a signal, then exits with ``EXIT_RESTART``)."""
    following = asyncio.create_task(follower.run(stop), name="generations")
    stopped = asyncio.create_task(stop.wait())
    await asyncio.wait([following, stopped], return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if not following.done():
        following.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await following
        return None
    error = following.exception()
    if isinstance(error, Restart):
        logger.warning("%s: starting again", error.why)
        stop.set()
        return error
    if error is not None:
        raise error
    return None
