"""Client side of the embedding servers: routes keys to shards and calls them in parallel.

(Over 400 lines: routing, the parallel calls and routing again after a re-sharding are one piece of
state, the shard map in force.)
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import numpy as np
from numba import njit

from bagpipe import serving
from bagpipe.core.embedding_init import InitialRows
from bagpipe.core.shard_map import ShardMap
from bagpipe.errors import InvalidArgument
from bagpipe.rpc import Moved, call_with_retry
from bagpipe.v1 import embedding_server_pb2 as pb
from bagpipe.v1 import embedding_server_pb2_grpc as pb_grpc
from bagpipe.wire import decode_message, encode_message, from_tensor, gather, serialized

logger = logging.getLogger(__name__)

# the most keys one Lookup or WriteBack carries: clients split larger ones at this size, and servers refuse
# a request of more (embedding_server/caps.py sizes the requests' caps by it)
MAX_ROWS_PER_RPC = 1 << 18
# a request refused for its shard-map version waits at most this long for the servers to switch
SWITCH_TIMEOUT_S = 120.0
T = TypeVar("T")


@njit(cache=True, nogil=True)
def _put_packed(rows, state, positions, packed):  # type: ignore[no-untyped-def]
    """``rows[positions], state[positions] = packed[:, :dim], packed[:, dim:]`` in one pass over the reply:
    numpy's two scattering assignments from the strided halves took three times as long."""
    dim = rows.shape[1]
    for i in range(positions.size):
        p = np.uint64(positions[i])  # (unsigned: no wrap-around code per access)
        for j in range(dim):
            rows[p, j] = packed[i, j]
        for j in range(state.shape[1]):
            state[p, j] = packed[i, dim + j]


class _Refused(Exception):
    """A server refused a request for its shard-map version, or is gone under a newer map: the request was
    not applied, and goes again under the map in force."""


class ShardMapChanged(RuntimeError):
    """Servers refused a request for its shard-map version, and no usable newer version came."""


@dataclass(frozen=True)
class _Route:
    """One shard-map version and a stub for each shard that holds buckets in it."""

    shard_map: ShardMap
    stubs: dict[int, _Stub]


class _Stub(pb_grpc.EmbeddingServerStub):
    """The generated stub, but ``Lookup`` and ``WriteBack`` take requests already serialised
    (``wire.encode_message``), so the rows a trainer writes back are copied into the request once."""

    def __init__(self, channel: grpc.Channel) -> None:
        super().__init__(channel)
        service = pb.DESCRIPTOR.services_by_name["EmbeddingServer"].full_name
        # a lookup's reply stays bytes: read by wire.decode_message, the rows are copied once, into place
        self.Lookup = channel.unary_unary(f"/{service}/Lookup", request_serializer=serialized)
        self.WriteBack = channel.unary_unary(
            f"/{service}/WriteBack",
            request_serializer=serialized,
            response_deserializer=pb.WriteBackResponse.FromString,
        )


Resolver = Callable[[], tuple["ShardMap | None", dict[int, str]]]
# starts one shard's calls for the positions given (the last argument: the first shard of this round);
# what it returns waits for them and gives the positions refused for their version
_Start = Callable[["_Route", int, np.ndarray, bool], Callable[[], np.ndarray]]
_Started = tuple["_Route", list[Callable[[], np.ndarray]]]


class PendingLookup:
    """A lookup in flight (``EmbeddingClient.lookup_async``)."""

    def __init__(self, finish: Callable[[], tuple[np.ndarray, np.ndarray]]) -> None:
        self._finish: Callable[[], tuple[np.ndarray, np.ndarray]] | None = finish
        self._result: tuple[np.ndarray, np.ndarray] | None = None

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        """Waits for the replies; the rows and optimizer state of the keys, as ``lookup`` returns them (the
        same arrays on every call)."""
        if self._finish is not None:
            self._result, self._finish = self._finish(), None
        assert self._result is not None
        return self._result


class EmbeddingClient:
    """Batched lookup and write-back across all shards of the shard map.

    With a ``resolver`` (the map in force and the servers' addresses, from Redis), a request a server
    refuses for its shard-map version (FAILED_PRECONDITION: the servers re-shard) is routed again under
    the map in force and retried, part by part: a part a server refused was not applied there, and a
    part it took is not sent again, so no write-back is lost or applied twice.

    With ``initial`` (how the job's servers compute initial rows), lookups ask the servers to leave out
    the rows that are still initial, and compute those here: a few nanoseconds a value, against
    gathering, sending and receiving them. A server that computes them otherwise sends every row.
    """

    def __init__(
        self,
        shard_map: ShardMap,
        addresses: dict[int, str],
        dim: int,
        state_width: int,
        resolver: Resolver | None = None,
        initial: InitialRows | None = None,
    ) -> None:
        if initial is not None and initial.dim != dim:
            raise ValueError(f"initial rows of width {initial.dim} for rows of width {dim}")
        self.dim = dim
        self.state_width = state_width
        self.initial = initial
        self._resolver = resolver
        self._channels: dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()
        self._route = self._routing(shard_map, addresses)
        self._pool = ThreadPoolExecutor(max_workers=max(4, len(addresses)), thread_name_prefix="emb-rpc")
        self.bytes_sent = 0
        self.bytes_received = 0
        self.refusals = 0  # requests a server refused for their shard-map version (then routed again)
        self.initial_rows = 0  # rows lookups were answered as still initial, computed here

    @property
    def shard_map(self) -> ShardMap:
        return self._route.shard_map

    @property
    def shard_map_version(self) -> int:
        return self._route.shard_map.version

    def _routing(self, shard_map: ShardMap, addresses: dict[int, str]) -> _Route:
        """(Under ``_lock``, or in ``__init__``.)"""
        missing = sorted(set(shard_map.owners) - set(addresses))
        if missing:
            raise ValueError(
                f"addresses: no address for shards {missing} (shard map version {shard_map.version})"
            )
        for s in shard_map.owners:
            if addresses[s] not in self._channels:
                self._channels[addresses[s]] = serving.channel(addresses[s])
        return _Route(
            shard_map,
            {s: _Stub(self._channels[addresses[s]]) for s in shard_map.owners},
        )

    def refresh(self, newer_than: int | None = None) -> bool:
        """Re-reads the map in force; True if it is newer than ``newer_than`` (default: the one in use),
        and then uses it."""
        if self._resolver is None:
            return False
        if newer_than is None:
            newer_than = self._route.shard_map.version
        shard_map, addresses = self._resolver()
        if shard_map is None or shard_map.version <= newer_than:
            return False
        with self._lock:
            if shard_map.version > self._route.shard_map.version:
                self._route = self._routing(shard_map, addresses)
                logger.info(
                    "embedding servers: shard map version %d, shards %s", shard_map.version, shard_map.owners
                )
        return True

    def _each_shard(self, keys: np.ndarray, call: Callable[[_Route, int, np.ndarray], np.ndarray]) -> None:
        """Runs ``call(route, shard, positions)`` in parallel for the keys of each shard; ``call`` returns the
        positions its server refused for their version, which go again under the map in force. The first
        shard's call runs on this thread, the others' on the pool: a call that reaches one shard (one
        server, or a write-back group of one shard's rows) hands nothing over."""

        def start(route: _Route, shard: int, positions: np.ndarray, first: bool) -> Callable[[], np.ndarray]:
            if first:
                return functools.partial(call, route, shard, positions)
            return self._pool.submit(call, route, shard, positions).result

        self._finish_shards(keys, self._start_shards(keys, None, start), start)

    def _start_shards(self, keys: np.ndarray, pending: np.ndarray | None, start: _Start) -> _Started:
        """Starts the calls for the keys at ``pending`` (None: every key) under the map in force:
        ``start(route, shard, positions, first)`` per shard that holds some, ``first`` for one of them."""
        route = self._route
        split = route.shard_map.split(keys if pending is None else keys[pending])
        parts = [(s, p if pending is None else pending[p]) for s, p in enumerate(split) if p.size]
        return route, [start(route, s, p, i == 0) for i, (s, p) in enumerate(parts)]

    def _finish_shards(self, keys: np.ndarray, started: _Started, start: _Start) -> None:
        """Waits for the calls ``_start_shards`` started, in order; the positions they return as refused for
        their version go again under the map in force (a newer one, or the same once the servers switched)."""
        deadline = time.monotonic() + SWITCH_TIMEOUT_S
        wait = 0.005
        while True:
            route, waits = started
            refused = [w() for w in waits]
            pending = np.concatenate(refused) if refused else np.zeros(0, dtype=np.int64)
            if not pending.size:
                return
            self.refusals += 1
            if self._resolver is None:
                raise ShardMapChanged(
                    f"a server refused shard map version {route.shard_map.version}; no resolver"
                )
            if not self.refresh(route.shard_map.version) and self._route is route:
                # no newer map: a server is still switching (or not yet): the same parts again, shortly
                if time.monotonic() > deadline:
                    raise ShardMapChanged(
                        f"servers refused shard map version {route.shard_map.version} for "
                        f"{SWITCH_TIMEOUT_S:g} s"
                    )
                time.sleep(wait)
                wait = min(0.5, 2 * wait)
            started = self._start_shards(keys, pending, start)

    def _send(
        self,
        route: _Route,
        shard: int,
        positions: np.ndarray,
        what: str,
        rpc: Callable[[Any, np.ndarray], Any],
    ) -> np.ndarray:
        """Sends the keys at ``positions`` to ``shard`` in parts of at most ``MAX_ROWS_PER_RPC``
        (``rpc(stub, part)``); returns the positions from the first part the server refused for its version
        (or, drained, did not answer under a newer map) on: that part and the later ones were not applied."""
        for start in range(0, positions.size, MAX_ROWS_PER_RPC):
            part = positions[start : start + MAX_ROWS_PER_RPC]
            try:
                self._call(route, f"{what} shard {shard}", functools.partial(rpc, route.stubs[shard], part))
            except _Refused:
                return positions[start:]
        return positions[:0]

    def _call(self, route: _Route, what: str, call: Callable[[], T], sending: grpc.Future | None = None) -> T:
        """``call()``'s answer, or ``sending``'s (the same call, already in flight) when given. UNAVAILABLE
        is retried with backoff (``call_with_retry``; after a call in flight that failed so, its attempts
        follow). ``_Refused`` when the server refused the request for its shard-map version, or is gone
        under a newer map: the request was not applied."""
        moved = functools.partial(self.refresh, route.shard_map.version)
        try:
            if sending is not None:
                try:
                    return sending.result()  # type: ignore[no-any-return]
                except grpc.RpcError as e:
                    if e.code() != grpc.StatusCode.UNAVAILABLE:
                        raise
                    if moved():
                        raise _Refused(what) from e
                    logger.warning("%s: unavailable, retrying", what)
                    time.sleep(0.1)
            return call_with_retry(call, what, moved)
        except Moved as e:
            raise _Refused(what) from e
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                raise _Refused(what) from e
            raise

    def initial_of(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The initial rows of ``keys`` and their zero optimizer state, computed here (a store whose
        ``untouched`` held, and whose keys no write has reached since, holds exactly these)."""
        if self.initial is None:
            raise ValueError("initial_of: this client computes no initial rows")
        return self.initial.rows(keys), np.zeros((keys.size, self.state_width), dtype=np.float32)

    def lookup(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Rows and optimizer state of ``keys`` (any order, distinct), as float32 arrays."""
        return self._lookup_rows(keys, blocking=True).result()

    def lookup_async(self, keys: np.ndarray) -> PendingLookup:
        """``lookup``, sent now and read by ``result()``: each shard's (first) request goes out before this
        returns, so one thread can keep several lookups in flight. Every reply is read and copied into place
        on the thread that asks for the result: no hand-over to a thread per lookup, whose wake-ups under the
        GIL cost more CPU than the calls (bench/README.md, "Embedding server")."""
        return self._lookup_rows(keys, blocking=False)

    def _lookup_rows(self, keys: np.ndarray, blocking: bool) -> PendingLookup:
        rows = np.empty((keys.size, self.dim), dtype=np.float32)
        state = np.empty((keys.size, self.state_width), dtype=np.float32)

        def put(part: np.ndarray, part_rows: np.ndarray, part_state: np.ndarray) -> None:
            rows[part], state[part] = part_rows, part_state

        def put_packed(part: np.ndarray, packed: np.ndarray) -> None:
            _put_packed(rows, state, part, packed)  # (a reply's rows and state side by side: one pass)

        start = self._lookup_start(keys, put, put_packed, blocking)
        started = self._start_shards(keys, None, start)

        def finish() -> tuple[np.ndarray, np.ndarray]:
            self._finish_shards(keys, started, start)
            return rows, state

        return PendingLookup(finish)

    def lookup_parts(self, keys: np.ndarray) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """``lookup`` as the servers answered it: per reply, the positions in ``keys`` it answers and their
        rows and state, read-only views of the reply. For a caller that copies the rows on anyway (the
        trainer's prefetch, into its cache), this saves gathering them into one array first."""
        parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        start = self._lookup_start(keys, lambda *part: parts.append(part), None, blocking=True)
        self._finish_shards(keys, self._start_shards(keys, None, start), start)
        return parts

    def _lookup_start(
        self,
        keys: np.ndarray,
        put: Callable[[np.ndarray, np.ndarray, np.ndarray], None],
        put_packed: Callable[[np.ndarray, np.ndarray], None] | None,
        blocking: bool,
    ) -> _Start:
        """How a lookup of ``keys`` starts its calls to one shard (see ``_start_shards``), and what waits for
        them, reads each reply and calls ``put(positions, rows, state)``, or ``put_packed(positions,
        packed)`` for rows that arrive each followed by its state (``packed``, ``[n, dim + state_width]``).
        Not ``blocking``: the calls go out as futures, and the replies are read on the waiting thread.
        ``blocking``: the first shard's calls are made on the waiting thread, the others' on the pool, each
        a plain call. A lookup that reaches one shard then makes one plain call on the calling thread;
        across two servers a pool thread's plain call cost less than a future (whose replies a channel's
        thread, started for it, hands over): 4.4-5.1 against 5.1-5.3 ms a lookup of 3,000 rows."""

        fingerprint = self.initial.fingerprint if self.initial is not None else 0

        def take(part: np.ndarray, data: bytes) -> None:
            reply = decode_message(data, pb.LookupResponse.DESCRIPTOR)
            sent = part  # the positions whose rows the reply holds
            initial = self._initial_positions(reply.initial, part.size)
            if initial.size:  # (still initial: computed here)
                mine = part[initial]
                put(mine, *self.initial_of(keys[mine]))
                self.initial_rows += initial.size
                kept = np.ones(part.size, dtype=bool)
                kept[initial] = False
                sent = part[kept]
            if reply.packed.dtype:  # (rows and state side by side; servers before it sent them apart)
                width = self.dim + self.state_width
                packed = from_tensor(reply.packed, "packed", np.float32, shape=(sent.size, width))
                if put_packed is not None:
                    put_packed(sent, packed)
                else:
                    put(sent, packed[:, : self.dim], packed[:, self.dim :])
            else:
                rows = from_tensor(reply.rows, "rows", np.float32, shape=(sent.size, self.dim))
                shape = (sent.size, self.state_width)
                put(sent, rows, from_tensor(reply.state, "state", np.float32, shape=shape))
            self.bytes_received += len(data)

        def start(route: _Route, shard: int, positions: np.ndarray, first: bool) -> Callable[[], np.ndarray]:
            stub = route.stubs[shard]
            calls: list[tuple[np.ndarray, bytes, grpc.Future | None]] = []
            for begin in range(0, positions.size, MAX_ROWS_PER_RPC):
                part = positions[begin : begin + MAX_ROWS_PER_RPC]
                request = encode_message([(1, route.shard_map.version), (2, keys[part]), (3, fingerprint)])
                # (a shard's later parts, past MAX_ROWS_PER_RPC rows, go out one by one as the replies are
                # read, so that one reply of that size at a time is in flight and held)
                sending = (
                    None if blocking or calls else stub.Lookup.future(request, timeout=serving.RPC_TIMEOUT_S)
                )
                calls.append((part, request, sending))

            def wait() -> np.ndarray:
                refused = []
                for part, request, sending in calls:
                    call = functools.partial(stub.Lookup, request, timeout=serving.RPC_TIMEOUT_S)
                    try:
                        data = self._call(route, f"lookup shard {shard}", call, sending)
                    except _Refused:  # (not answered under this map: routed again)
                        refused.append(part)
                        continue
                    self.bytes_sent += len(request)
                    take(part, data)
                return np.concatenate(refused) if refused else positions[:0]

            return wait if first or not blocking else self._pool.submit(wait).result

        return start

    def _initial_positions(self, tensor: Any, n: int) -> np.ndarray:
        """A reply's ``initial`` (absent: none): ascending positions in ``[0, n)``, only for a client that
        computes initial rows."""
        if not tensor.dtype:
            return np.zeros(0, dtype=np.int64)
        initial = from_tensor(tensor, "initial", np.int64, ndim=1)
        if self.initial is None and initial.size:
            raise InvalidArgument("initial", "rows left out of a reply to a client that computes none")
        if initial.size and not (initial[0] >= 0 and initial[-1] < n and (np.diff(initial) > 0).all()):
            raise InvalidArgument("initial", f"positions must ascend within [0, {n})")
        return initial

    def untouched(self) -> bool:
        """Whether every server of the map in force holds only initial rows that this client computes as
        it does (the same fingerprint): nothing stored into any row since it was filled. A server that
        cannot say so (another fingerprint, a migration under way, a version refused) counts as touched."""
        if self.initial is None:
            return False
        route = self._route
        no_keys = np.zeros(0, dtype=np.int64)
        request = encode_message(
            [(1, route.shard_map.version), (2, no_keys), (3, self.initial.fingerprint), (4, True)]
        )

        def one(shard: int) -> bool:
            try:
                data = call_with_retry(
                    functools.partial(route.stubs[shard].Lookup, request, timeout=serving.RPC_TIMEOUT_S),
                    f"lookup shard {shard}",
                )
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.FAILED_PRECONDITION:  # (re-sharding: a version refused)
                    raise
                return False
            return bool(decode_message(data, pb.LookupResponse.DESCRIPTOR).untouched)

        return all(self._pool.map(one, route.stubs))

    def write_back(self, keys: np.ndarray, rows: np.ndarray, state: np.ndarray) -> None:
        """Stores rows and state; returns once every shard has acknowledged (durable in memory)."""

        def one(route: _Route, stub: Any, part: np.ndarray) -> None:
            version = route.shard_map.version
            request = encode_message(
                [(1, version), (2, keys[part]), (3, gather(rows, part)), (4, gather(state, part))]
            )
            stub.WriteBack(request, timeout=serving.RPC_TIMEOUT_S)
            self.bytes_sent += len(request)

        self._each_shard(keys, lambda r, s, p: self._send(r, s, p, "write-back", functools.partial(one, r)))

    def snapshot(self, directory: str, next_batch: int, full: bool = False) -> list[tuple[str, int, int]]:
        """Has every shard write its changed rows (``full``: every row not initial) into the checkpoint
        ``next_batch`` of ``directory``, in parallel; returns (file, rows, bytes) per shard. The caller holds
        the re-sharding lock (``RESHARD_LOCK``), so the map in force cannot change meanwhile. A retried call
        is answered as the first was (the servers' Snapshot is idempotent)."""
        self.refresh()
        route = self._route

        def one(shard: int) -> tuple[str, int, int]:
            request = pb.SnapshotRequest(
                shard_map_version=route.shard_map.version,
                directory=directory,
                next_batch=next_batch,
                full=full,
            )
            reply = call_with_retry(
                lambda: route.stubs[shard].Snapshot(request, timeout=serving.RPC_TIMEOUT_S),
                f"snapshot shard {shard}",
                retry=(grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED),
            )
            return reply.file, reply.rows, reply.bytes

        return list(self._pool.map(one, sorted(route.stubs)))

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for c in self._channels.values():
            c.close()
