"""One build of each batch for the K streams a data processor serves to K oracle shards.

With ``--oracles K`` every oracle shard opens its own StreamBatches call on every processor, asking for
the same batches (the same start, stride and end) and differing only in ``shard``: each takes its keys'
part of every batch (``server.oracle_part``). Built stream by stream, each batch would be read, parsed,
deduplicated and masked K times. Instead the K streams of one request join a :class:`SharedBuilds`: the
first stream to need a batch builds it (with its trainer masks and its split by shard, ``KeyShards.split``),
and the others take it from the group's last ``keep`` builds. The shards read in near lockstep (the
trainers take every shard's plan of a batch together, and an oracle reads at most a few strides ahead of
its window), so a build is taken by every stream while it is kept.

A stream that needs a batch the group no longer keeps (it fell behind by more than ``keep`` batches, or a
rewound shard asks again for a batch already served) joins another group that can serve it, or starts
one of its own: batches are a function of their number, so a stream gets the same batch whichever build
served it.

The K shards do not open their streams at the same instant (each is a process, or a pod, of its own),
and in a short job the first may read every batch before the last has asked for one. So a group whose
streams have all left stays, with its kept builds, until K streams have joined it, or for ``GRACE_S``
seconds (a shard that failed may never come back for it).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from bagpipe.core.oracle_shards import Split

KEEP = 32  # builds a group keeps for the streams behind the one that built them
GRACE_S = 30.0  # how long a group all of whose streams left waits for the shards that have not joined


@dataclass(frozen=True)
class Built:
    """One batch as built once for every shard's stream: its arrays and ``last`` flag, its keys' trainer
    masks (None: none asked for) and its keys' split by oracle shard."""

    arrays: Any  # BatchArrays
    last: bool
    users: Any  # np.ndarray | None
    split: Split


# builds from batch ``start`` on (every stride-th), each with the seconds it took
Builder = Callable[[int], Iterator[Built]]


class SharedBuilds:
    """The builds of one request's batches, from ``start`` on, for the streams that joined it."""

    def __init__(self, builder: Builder, start: int, stride: int, keep: int = KEEP) -> None:
        self._builds = builder(start)
        self._stride = stride
        self._next = start  # the batch the builder yields next
        self._ended = False
        self._error: BaseException | None = None  # the build that failed: every stream fails with it
        self._kept: OrderedDict[int, Built] = OrderedDict()
        self._keep = keep
        self._lock = threading.Lock()
        self.streams = 0  # joined and not yet left (the registry's count)
        self.first = start
        self.joined = 0  # streams that ever joined
        self.idle_since: float | None = None  # when its last stream left (monotonic), if it waits for more

    def can_serve(self, number: int) -> bool:
        """Whether batch ``number`` is kept, or is among the next ``keep`` this group builds (a stream
        further ahead would have this group build, and drop, the batches between for nobody). A group
        whose build failed serves no new stream. Read without the group's lock, which a build holds: a
        stream joining or leaving does not wait for one. An answer out of date by a build is harmless
        (``take`` says so, and the stream joins another group)."""
        if self._error is not None:
            return False
        if number in self._kept:
            return True
        return not self._ended and 0 <= number - self._next < self._keep * self._stride

    def take(self, number: int) -> tuple[Built | None, bool]:
        """Batch ``number`` and whether this call built it (rather than a stream before it), building up
        to it; (None, False) when the data ended before it. ``LookupError`` when it is no longer kept."""
        with self._lock:
            kept = self._kept.get(number)
            if kept is not None:
                return kept, False
            if self._error is not None:
                raise self._error
            if number < self._next:
                raise LookupError(f"batch {number}: built and no longer kept")
            built = None
            while not self._ended and self._next <= number:
                try:
                    built = next(self._builds, None)
                except BaseException as e:
                    self._error = e
                    raise
                if built is None:
                    self._ended = True
                    break
                number_built = int(built.arrays.number)
                self._kept[number_built] = built
                while len(self._kept) > self._keep:
                    self._kept.popitem(last=False)
                self._next = number_built + 1
                if built.last:
                    self._ended = True
            if built is None or int(built.arrays.number) != number:
                return None, False  # (the data ended, or the stride steps past it: no such batch)
            return built, True


class BuildRegistry:
    """The open groups of a processor's oracle-shard streams, by request (start, stride, end, trainers,
    oracles)."""

    def __init__(self, keep: int = KEEP, grace_s: float = GRACE_S) -> None:
        self._groups: dict[tuple[int, ...], list[SharedBuilds]] = {}
        self._lock = threading.Lock()
        self._keep = keep
        self._grace_s = grace_s

    def join(self, request: tuple[int, ...], number: int, stride: int, builder: Builder) -> SharedBuilds:
        """A group of ``request`` that can serve batch ``number`` (a new one if none can)."""
        with self._lock:
            self._drop_idle()
            groups = self._groups.setdefault(request, [])
            for group in groups:
                if group.can_serve(number):
                    group.streams += 1
                    group.joined += 1
                    group.idle_since = None
                    return group
            group = SharedBuilds(builder, number, stride, self._keep)
            group.streams = group.joined = 1
            groups.append(group)
            return group

    def leave(self, request: tuple[int, ...], group: SharedBuilds) -> None:
        """A stream of ``group`` ended: the group goes with its last stream once as many streams as the
        request has oracle shards (its last field) joined it; until then it waits ``grace_s`` for them."""
        with self._lock:
            group.streams -= 1
            if group.streams == 0:
                if group.joined < request[-1] and group.can_serve(group.first):
                    group.idle_since = time.monotonic()
                else:
                    self._drop(request, group)
            self._drop_idle()

    def _drop(self, request: tuple[int, ...], group: SharedBuilds) -> None:
        groups = self._groups.get(request, [])
        if group in groups:
            groups.remove(group)
        if not groups:
            self._groups.pop(request, None)

    def _drop_idle(self) -> None:
        """Drops the groups that waited ``grace_s`` for shards that did not come (the lock held)."""
        now = time.monotonic()
        for request, groups in list(self._groups.items()):
            for group in list(groups):
                if group.idle_since is not None and now - group.idle_since >= self._grace_s:
                    self._drop(request, group)

    def open_groups(self) -> int:
        with self._lock:
            self._drop_idle()
            return sum(len(g) for g in self._groups.values())


def shared_stream(
    registry: BuildRegistry, request: tuple[int, ...], start: int, stride: int, builder: Builder
) -> Iterator[tuple[Built, bool]]:
    """A stream's batches ``start, start+stride, ...`` from the groups of ``request``, each with whether
    this stream built it; ends after the last batch or when the data ends."""
    number = start
    group = registry.join(request, number, stride, builder)
    try:
        while True:
            try:
                built, mine = group.take(number)
            except LookupError:  # fell behind the group: another that can serve it, or a new one
                registry.leave(request, group)
                group = registry.join(request, number, stride, builder)
                continue
            if built is None:
                return
            yield built, mine
            if built.last:
                return
            number += stride
    finally:
        registry.leave(request, group)
