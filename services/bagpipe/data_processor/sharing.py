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
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from bagpipe.core.oracle_shards import Split

KEEP = 32  # builds a group keeps for the streams behind the one that built them


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

    def __init__(self, keep: int = KEEP) -> None:
        self._groups: dict[tuple[int, ...], list[SharedBuilds]] = {}
        self._lock = threading.Lock()
        self._keep = keep

    def join(self, request: tuple[int, ...], number: int, stride: int, builder: Builder) -> SharedBuilds:
        """A group of ``request`` that can serve batch ``number`` (a new one if none can)."""
        with self._lock:
            groups = self._groups.setdefault(request, [])
            for group in groups:
                if group.can_serve(number):
                    group.streams += 1
                    return group
            group = SharedBuilds(builder, number, stride, self._keep)
            group.streams = 1
            groups.append(group)
            return group

    def leave(self, request: tuple[int, ...], group: SharedBuilds) -> None:
        """A stream of ``group`` ended: the group goes with its last stream."""
        with self._lock:
            group.streams -= 1
            if group.streams == 0:
                groups = self._groups.get(request, [])
                if group in groups:
                    groups.remove(group)
                if not groups:
                    self._groups.pop(request, None)

    def open_groups(self) -> int:
        with self._lock:
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
