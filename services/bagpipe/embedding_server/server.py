"""The EmbeddingServer servicer and ``create_server``.

(Over 400 lines: every RPC, a migration's steps included, runs under the one rows gate this module
keeps.)

Without threads (below), handlers run on the asyncio loop and do not await between validating a
request and applying it, so each lookup or write-back is atomic with respect to the others and a
rejected one changes nothing. The same holds for the steps of a migration that touch rows (a chunk's
copy, the seal, a received message): see ``shard_store.py`` for why no write is lost or applied twice.

With ``lookup_threads``, the work on rows moves off the loop, so that a server with cores to spare
serves several lookups at once and keeps receiving and sending (about half of its work is gRPC's, on
the loop) while rows are stored:
* a lookup is validated and its rows named on the loop as before, but its rows are copied into the
  reply on one of those threads (the compiled gather releases the GIL), several at once;
* a write-back is validated on the loop and its rows checked and stored on one of them
  (``_store_rows`` releases the GIL too), one write-back at a time, in the order they arrived.
``_RowsGate`` keeps this exact: a write-back, and every other handler that reads or changes rows on
the loop (a snapshot, a migration's steps), runs alone: it waits until no copy is in flight and no
other such handler runs, and no copy starts while one waits. So a lookup still sees each write-back
whole or not at all, and a snapshot or a migration never sees one half stored.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import numpy as np

from bagpipe import serving
from bagpipe.core import snapshots
from bagpipe.core.shard_map import ShardMap
from bagpipe.embedding_server import metrics
from bagpipe.embedding_server.caps import request_caps
from bagpipe.embedding_server.client import MAX_ROWS_PER_RPC
from bagpipe.embedding_server.row_tier import Schedule
from bagpipe.embedding_server.shard_store import Migration, ShardStore
from bagpipe.errors import FailedPrecondition, InvalidArgument, Unavailable
from bagpipe.health_service import HealthService
from bagpipe.v1 import embedding_server_pb2 as pb
from bagpipe.v1 import embedding_server_pb2_grpc as pb_grpc
from bagpipe.wire import Gather, encode_message, from_tensor, to_tensor

logger = logging.getLogger(__name__)


# rows per migration message: small enough that lookups and write-backs interleave with the copy
MIGRATION_CHUNK_ROWS = 1 << 13
# requests read as views of their bytes (wire.decode_message): a write-back's rows are copied once, into
# the store
RAW_REQUESTS = ("Lookup", "WriteBack")


class _RowsGate:
    """Lookups whose rows are being copied off the loop (``copying``, any number at once), and the
    handlers that store or read rows otherwise (``changing``, one at a time, in the order they came):
    ``changing`` returns once no copy is in flight and no other handler holds it, and while any handler
    waits there, no ``copying`` starts (so a steady stream of lookups cannot hold a write-back off).
    Without threads nothing awaits here: every handler then runs whole within one step of the loop."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.changers = 0
        self._none_in_flight = asyncio.Event()
        self._none_in_flight.set()
        self._no_changers = asyncio.Event()
        self._no_changers.set()
        self._alone = asyncio.Lock()

    @contextlib.asynccontextmanager
    async def copying(self) -> AsyncIterator[None]:
        while self.changers:
            await self._no_changers.wait()
        self.in_flight += 1
        self._none_in_flight.clear()
        try:
            yield
        finally:
            self.in_flight -= 1
            if not self.in_flight:
                self._none_in_flight.set()

    @contextlib.asynccontextmanager
    async def changing(self) -> AsyncIterator[None]:
        self.changers += 1
        self._no_changers.clear()
        try:
            async with self._alone:
                while self.in_flight:
                    await self._none_in_flight.wait()
                yield
        finally:
            self.changers -= 1
            if not self.changers:
                self._no_changers.set()


async def _off_loop(pool: ThreadPoolExecutor | None, work: Any, *args: Any) -> Any:
    """``work(*args)`` on ``pool``. A call cancelled meanwhile (its client gone) still waits for the
    thread, which goes on with the rows, before the caller's gate is let go."""
    done = asyncio.get_running_loop().run_in_executor(pool, work, *args)
    try:
        return await asyncio.shield(done)
    finally:
        while not done.done():  # (however often the call is cancelled meanwhile)
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait([done])


def _refuse_unwritten(error: BaseException) -> None:
    """A snapshot the disk refused: ``directory:`` (FAILED_PRECONDITION) when a replay would fail the same
    way (a full or read-only volume: the trainer fails the job, exit 74), ``snapshot:`` (UNAVAILABLE) when it
    may pass (the trainer's failure is recovered from like any other)."""
    if isinstance(error, OSError):
        if snapshots.final(error):
            raise FailedPrecondition(f"directory: cannot write the snapshot: {error}") from error
        raise Unavailable(f"snapshot: cannot write the snapshot (may pass): {error}") from error


class EmbeddingServicer(pb_grpc.EmbeddingServerServicer):
    def __init__(self, store: ShardStore, lookup_threads: int = 0) -> None:
        if lookup_threads < 0:
            raise ValueError(f"lookup_threads: must be >= 0, got {lookup_threads}")
        self.store = store
        self._peers: dict[int, grpc.aio.Channel] = {}
        self._rows_per_second = 0.0
        # every migration attempt prepared here: the coordinator never repeats one, so a Prepare that does
        # is from the past (its aborted try, arriving late)
        self._attempts: set[int] = set()
        self._ready = asyncio.Event()
        self._gate = _RowsGate()
        self._pool = ThreadPoolExecutor(lookup_threads, thread_name_prefix="rows") if lookup_threads else None
        # the last Snapshot asked for, (directory, next_batch, full), and its reply to come
        self._last_snapshot: tuple[tuple[str, int, bool], asyncio.Future[pb.SnapshotResponse]] | None = None
        # why a write-back with this call metadata is refused (control/generation.py), checked again once
        # it holds the rows gate: one let in before a roll-back began must not land after it
        self.fence: Callable[[Any], str | None] | None = None

    def _check_version(self, version: int) -> None:
        """Requests name the shard-map version they were routed by; any other is refused (the client
        re-reads the map from Redis and retries), and so is every request while this server switches."""
        m = self.store.migration
        if m is not None and m.sealed:
            raise FailedPrecondition(
                f"shard_map_version: request has {version}, this server is switching to "
                f"{m.new_map.version}; retry"
            )
        if version != self.store.shard_map.version:
            raise FailedPrecondition(
                f"shard_map_version: request has {version}, this server has {self.store.shard_map.version}"
            )

    def _check_size(self, keys: Any) -> None:
        """Before anything is decoded or allocated: at most ``MAX_ROWS_PER_RPC`` keys in one request, the
        most a client sends (it splits larger lookups and write-backs at that size)."""
        n = int(keys.shape[0]) if len(keys.shape) == 1 else 0
        if n > MAX_ROWS_PER_RPC:
            raise InvalidArgument(
                "keys", f"{n} keys in one request; a client sends at most {MAX_ROWS_PER_RPC}"
            )

    def _migration(self, version: int, attempt: int) -> Migration:
        """The migration a Transfer, Receive or Seal of ``attempt`` to ``version`` belongs to: the one this
        server prepared, for that version and that very attempt. Anything else is refused before it
        touches a row: after an abort and a new Prepare of the same version, a message of the old attempt
        (a chunk still in flight, a late Seal) must not land in the new one."""
        m = self.store.migration
        if m is None or m.new_map.version != version:
            have = "none" if m is None else f"version {m.new_map.version}, attempt {m.attempt:x}"
            raise FailedPrecondition(
                f"shard_map_version: no migration to version {version} here ({have}); "
                f"attempt {attempt:x} is not under way"
            )
        if m.attempt != attempt:
            raise FailedPrecondition(
                f"attempt: {attempt:x} is stale; this server's migration to version {version} is "
                f"attempt {m.attempt:x}"
            )
        return m

    async def Lookup(self, request: pb.LookupRequest, context: grpc.aio.ServicerContext) -> bytes:  # noqa: N802
        """The reply is a serialised ``LookupResponse`` (``wire.encode_message``) with the rows as they are
        stored, each followed by its state (``packed``): they are gathered straight into its bytes
        (``wire.Gather``), not into an array first, nor split into rows and state. A client that
        computes initial rows as this server does (the same ``init_fingerprint``) gets the rows still
        initial as positions only, and, asked, whether every row of the shard is (``untouched``).
        With ``lookup_threads``, the rows are copied into the reply on one of those threads."""
        with metrics.LATENCY.labels("lookup").time():
            if self._pool is None:
                return encode_message(self._lookup(request))
            async with self._gate.copying():
                fields = self._lookup(request)
                reply: bytes = await _off_loop(self._pool, encode_message, fields)
                return reply

    def _lookup(self, request: pb.LookupRequest) -> list[tuple[int, Any]]:
        """A lookup's reply as ``encode_message`` fields, its rows not yet copied (``wire.Gather``)."""
        self._check_version(request.shard_map_version)
        self._check_size(request.keys)
        keys = from_tensor(request.keys, "keys", np.int64, ndim=1)
        fields: list[tuple[int, Any]]
        packed: Gather
        if request.init_fingerprint and request.init_fingerprint == self.store.fingerprint:
            initial, packed = self.store.gather_changed(keys)
            fields = [(3, packed), (4, initial)] if initial.size else [(3, packed)]
            if request.ask_untouched:
                fields.append((5, self.store.untouched()))
            metrics.INITIAL_ROWS.inc(initial.size)
        else:
            packed = self.store.rows(keys)
            fields = [(3, packed)]
        metrics.ROWS.labels("lookup").inc(keys.size)
        metrics.REQUESTS.labels("lookup").inc()
        metrics.BYTES.labels("lookup").inc(packed.nbytes)
        return fields

    async def WriteBack(
        self, request: pb.WriteBackRequest, context: grpc.aio.ServicerContext
    ) -> pb.WriteBackResponse:  # noqa: N802
        with metrics.LATENCY.labels("write_back").time():
            async with self._gate.changing():
                self._fenced(context)
                self._check_version(request.shard_map_version)
                self._check_size(request.keys)
                keys = from_tensor(request.keys, "keys", np.int64, ndim=1)
                n = keys.size
                rows = from_tensor(request.rows, "rows", np.float32, shape=(n, self.store.dim))
                state = from_tensor(request.state, "state", np.float32, shape=(n, self.store.state_width))
                if self._pool is None:
                    self.store.write(keys, rows, state)
                else:  # (checked whole before anything is stored, there as here)
                    await _off_loop(self._pool, self.store.write, keys, rows, state)
            metrics.ROWS.labels("write_back").inc(n)
            metrics.REQUESTS.labels("write_back").inc()
            metrics.BYTES.labels("write_back").inc(rows.nbytes + state.nbytes)
            return pb.WriteBackResponse(rows=n)

    async def Snapshot(
        self, request: pb.SnapshotRequest, context: grpc.aio.ServicerContext
    ) -> pb.SnapshotResponse:  # noqa: N802
        """Idempotent: a retry of the last snapshot (its reply lost, or the first call still writing) gets
        the first call's answer. Taking the changes again would write an empty file over its rows."""
        if not request.directory:
            raise InvalidArgument("directory", "empty")
        if request.next_batch < 1:
            raise InvalidArgument("next_batch", f"must be >= 1, got {request.next_batch}")
        key = (request.directory, request.next_batch, request.full)
        if self._last_snapshot is not None and self._last_snapshot[0] == key:
            return await asyncio.shield(self._last_snapshot[1])
        done: asyncio.Future[pb.SnapshotResponse] = asyncio.get_running_loop().create_future()
        done.add_done_callback(lambda f: f.cancelled() or f.exception())  # (a failure no retry awaited)
        self._last_snapshot = (key, done)
        try:
            reply = await self._snapshot(request, context)
        except BaseException as e:
            if self._last_snapshot is not None and self._last_snapshot[1] is done:
                self._last_snapshot = None  # (a retry after a failure writes again)
            done.set_exception(e if isinstance(e, Exception) else FailedPrecondition("snapshot cancelled"))
            raise
        done.set_result(reply)
        return reply

    def _fenced(self, context: grpc.aio.ServicerContext | None) -> None:
        """(Holding the rows gate.) A call let in before a roll-back began must not act after it."""
        if self.fence is None or context is None:
            return
        refused = self.fence(context.invocation_metadata())
        if refused is not None:
            raise FailedPrecondition(refused)

    async def _snapshot(
        self, request: pb.SnapshotRequest, context: grpc.aio.ServicerContext | None = None
    ) -> pb.SnapshotResponse:
        t0 = time.perf_counter()
        write = functools.partial(
            snapshots.write_rows, request.directory, request.next_batch, self.store.shard, full=request.full
        )
        if request.full:  # every row not initial, written from the table itself while no write can come
            async with self._gate.changing():
                self._fenced(context)
                self._check_version(request.shard_map_version)
                keys, gathered, gathered_state = self.store.take_all()
                self._undo_from(request.directory, request.next_batch)
                try:
                    name, size = await _off_loop(None, write, keys, gathered, gathered_state)
                except BaseException as e:
                    self.store.keep_all()
                    _refuse_unwritten(e)
                    raise
        else:
            async with self._gate.changing():  # (between write-backs), written out off the loop
                self._fenced(context)
                self._check_version(request.shard_map_version)  # (once no write-back or switch step runs)
                keys, rows, state = self.store.take_changes()
                self._undo_from(request.directory, request.next_batch)
            try:
                name, size = await asyncio.to_thread(write, keys, rows, state)
            except BaseException as e:  # (a cancelled call too) the next snapshot must still hold them
                await asyncio.shield(self._keep_changes(keys))
                _refuse_unwritten(e)
                raise
        metrics.SNAPSHOT_SECONDS.observe(time.perf_counter() - t0)
        metrics.SNAPSHOT_ROWS.inc(keys.size)
        logger.info(
            "%s snapshot for batch %d: %d rows, %d bytes",
            "full" if request.full else "incremental",
            request.next_batch,
            keys.size,
            size,
        )
        return pb.SnapshotResponse(file=name, rows=keys.size, bytes=size)

    def _undo_from(self, directory: str, next_batch: int) -> None:
        """(At a snapshot's cut.) The writes from now on are undone back to checkpoint ``next_batch``; those
        before the newest complete checkpoint will never be (a roll-back goes to the newest)."""
        self.store.undo_checkpoint(next_batch)
        self.store.forget_undo_before(snapshots.latest(directory) or 0)
        metrics.UNDO_ROWS.set(self.store.undo_rows)

    async def read_ahead(self, index: np.ndarray) -> int:
        """(A row tier.) Reads local rows ``index`` from disk into memory before the fetch that needs them:
        which ones is decided under the gate, the read runs on a thread while requests are served, and the
        rows still wanted then are taken in under the gate. Returns how many came in."""
        tier = self.store.tier
        if tier is None:
            return 0
        async with self._gate.changing():
            wanted = tier.ahead(index)
        if not wanted.size:
            return 0
        values, where = await asyncio.to_thread(tier.log.read_where, wanted)
        async with self._gate.changing():
            return tier.install(wanted, where, values) if self.store.tier is tier else 0

    async def roll_back(self, batch: int, version: int, rebuild: Callable[[int], ShardStore]) -> str:
        """Takes this shard back to checkpoint ``batch`` under shard-map ``version`` (the one in force):
        from the undo log when it reaches that far under that map (no file is read), else a shard built
        anew by ``rebuild`` (the seed, then the checkpoint chain). A migration under way is dropped (its
        coordinator tries again later). Returns what it did, for the log."""
        async with self._gate.changing():
            t0 = time.perf_counter()
            switching = self.store.migration is not None and self.store.migration.sealed
            if self.store.migration is not None and not switching:
                self._abort()
            self._last_snapshot = None
            # (a sealed switch cannot be undone: the shard is built anew under the map in force)
            same_map = self.store.shard_map.version == version and not switching
            if batch == 0 and same_map and self.store.untouched():
                said = "every row still initial"
            elif self.store.built_batch == batch and same_map:  # (--init-from's rows, and no checkpoints)
                said = f"holds checkpoint {batch} as it was built"
            elif self.store.can_undo_to(batch) and same_map:
                rows = self.store.undo_to(batch)
                said = f"undid {rows} rows in memory"
            else:
                old, self.store = self.store, await _off_loop(None, rebuild, batch)
                old.close()  # (a tier's files)
                said = f"rebuilt {self.store.rows_held} rows from the checkpoints"
            if self.store.tier is not None:  # (the plans start again from the checkpoint)
                self.store.tier.schedule = Schedule(self.store.local_rows)
            metrics.UNDO_ROWS.set(self.store.undo_rows)
            metrics.ROWS_HELD.set(self.store.rows_held)
            metrics.SHARD_MAP_VERSION.set(self.store.shard_map.version)
            return f"{said} in {time.perf_counter() - t0:.2f} s"

    async def _keep_changes(self, keys: np.ndarray) -> None:
        async with self._gate.changing():
            self.store.keep_changes(keys)

    # ---- re-sharding
    async def PrepareMigration(
        self, request: pb.PrepareMigrationRequest, context: grpc.aio.ServicerContext
    ) -> pb.PrepareMigrationResponse:  # noqa: N802
        async with self._gate.changing():
            return self._prepare(request)

    def _prepare(self, request: pb.PrepareMigrationRequest) -> pb.PrepareMigrationResponse:
        if not request.attempt:
            raise InvalidArgument("attempt", "must be nonzero (a new id for every try)")
        try:
            new_map = ShardMap.from_json(request.shard_map)
        except (ValueError, KeyError, TypeError) as e:
            raise InvalidArgument("shard_map", f"not a shard map: {e}") from None
        if request.attempt in self._attempts:  # (before it could change the map or abort the try under way)
            now = self.store.migration
            have = "none" if now is None else f"attempt {now.attempt:x} to version {now.new_map.version}"
            raise FailedPrecondition(
                f"attempt: {request.attempt:x} to version {new_map.version} was prepared or aborted here "
                f"before; a new try needs a new id (under way: {have})"
            )
        if request.rows_per_second < 0:
            raise InvalidArgument("rows_per_second", f"must be >= 0, got {request.rows_per_second}")
        if new_map.version != self.store.shard_map.version + 1 and request.current_shard_map:
            self._catch_up(request.current_shard_map, new_map)
        if new_map.version != self.store.shard_map.version + 1:
            raise FailedPrecondition(
                f"shard_map: version {new_map.version} does not follow this server's "
                f"{self.store.shard_map.version}"
            )
        if self.store.migration is not None:
            if self.store.migration.sealed:
                raise FailedPrecondition(
                    f"shard_map: this server is switching to {self.store.migration.new_map.version}"
                )
            self._abort()  # an earlier, interrupted attempt at the same version
        try:
            m = self.store.begin_migration(new_map, request.attempt)
        except ValueError as e:
            raise InvalidArgument("shard_map", str(e)) from None
        self._attempts.add(request.attempt)
        missing = sorted(set(m.leaving) - set(request.addresses))
        if missing:
            self.store.abort_migration()
            raise InvalidArgument("addresses", f"no address for shards {missing}")
        self._peers = {d: serving.aio_channel(request.addresses[d]) for d in m.leaving}
        self._rows_per_second = request.rows_per_second
        self._ready = asyncio.Event()
        metrics.MIGRATION_TARGET.set(new_map.version)
        logger.info(
            "migration to version %d (attempt %x): %d rows stay, %d leave, %d buckets arrive from shards %s",
            new_map.version,
            m.attempt,
            m.staying.size,
            sum(r.size for r in m.leaving.values()),
            m.incoming_buckets.size,
            sorted(m.sources),
        )
        return pb.PrepareMigrationResponse(
            staying_rows=m.staying.size if m.changes_layout else 0,
            leaving_rows=sum(r.size for r in m.leaving.values()),
            incoming_buckets=m.incoming_buckets.size,
        )

    def _catch_up(self, text: str, new_map: ShardMap) -> None:
        """A server that holds no rows (it joined, or was drained) takes over the map in force."""
        try:
            current = ShardMap.from_json(text)
        except (ValueError, KeyError, TypeError) as e:
            raise InvalidArgument("current_shard_map", f"not a shard map: {e}") from None
        if current.version != new_map.version - 1:
            raise InvalidArgument(
                "current_shard_map", f"version {current.version} is not the one before {new_map.version}"
            )
        if (
            self.store.migration is None
            and self.store.rows_held == 0
            and self.store.shard not in current.owners
            and current.version > self.store.shard_map.version  # (never back: a stale Prepare)
        ):
            self.store.adopt(current)

    async def _send(
        self,
        m: Migration,
        dst: int,
        keys: np.ndarray,
        rows: np.ndarray,
        state: np.ndarray,
        changed: np.ndarray | None = None,
    ) -> int:
        request = pb.ReceiveRequest(
            shard_map_version=m.new_map.version,
            attempt=m.attempt,
            from_shard=self.store.shard,
            keys=to_tensor(keys),
            rows=to_tensor(rows),
            state=to_tensor(state),
            last=changed is not None,
        )
        if changed is not None:
            request.changed_keys.CopyFrom(to_tensor(changed))
        stub = pb_grpc.EmbeddingServerStub(self._peers[dst])
        await stub.Receive(request, timeout=serving.RPC_TIMEOUT_S)
        size = rows.nbytes + state.nbytes
        metrics.MIGRATED_ROWS.labels("out").inc(keys.size)
        metrics.MIGRATED_BYTES.labels("out").inc(size)
        return size

    async def Transfer(
        self, request: pb.TransferRequest, context: grpc.aio.ServicerContext
    ) -> pb.TransferResponse:  # noqa: N802
        """The bulk copy, chunk by chunk between the requests it serves (rows read in one loop step)."""
        m = self._migration(request.shard_map_version, request.attempt)
        self._still(m)
        t0 = time.perf_counter()
        sent = size = copied = 0
        if m.changes_layout:
            for start in range(0, m.staying.size, MIGRATION_CHUNK_ROWS):
                async with self._gate.changing():
                    self._still(m)
                    m.copy_staying(m.staying[start : start + MIGRATION_CHUNK_ROWS])
                copied += min(MIGRATION_CHUNK_ROWS, m.staying.size - start)
                await asyncio.sleep(0)
        chunk = MIGRATION_CHUNK_ROWS  # throttled: about 20 chunks a second
        if self._rows_per_second:
            chunk = int(min(MIGRATION_CHUNK_ROWS, max(64, self._rows_per_second / 20)))
        for dst, rows in m.leaving.items():
            for start in range(0, rows.size, chunk):
                async with self._gate.changing():
                    self._still(m)
                    keys, w, st = self.store.read_rows(rows[start : start + chunk])
                size += await self._send(m, dst, keys, w, st)
                sent += keys.size
                if self._rows_per_second:  # throttled: the trainers' transfers keep their bandwidth
                    await asyncio.sleep(max(0.0, sent / self._rows_per_second - (time.perf_counter() - t0)))
        logger.info(
            "migration to version %d: %d rows sent, %d copied in %.2f s",
            m.new_map.version,
            sent,
            copied,
            time.perf_counter() - t0,
        )
        return pb.TransferResponse(rows_sent=sent, bytes_sent=size, rows_copied=copied)

    def _still(self, m: Migration) -> None:
        """``m`` is still the migration under way, and not yet sealed."""
        if self.store.migration is not m:
            raise FailedPrecondition(
                f"attempt: {m.attempt:x} to version {m.new_map.version} was aborted meanwhile"
            )
        if m.sealed:
            raise FailedPrecondition(f"shard_map_version: {m.new_map.version} is already sealed")

    async def Receive(
        self, request: pb.ReceiveRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReceiveResponse:  # noqa: N802
        keys = from_tensor(request.keys, "keys", np.int64, ndim=1)
        n = keys.size
        rows = from_tensor(request.rows, "rows", np.float32, shape=(n, self.store.dim))
        state = from_tensor(request.state, "state", np.float32, shape=(n, self.store.state_width))
        changed = (
            from_tensor(request.changed_keys, "changed_keys", np.int64, ndim=1) if request.last else None
        )
        async with self._gate.changing():
            # (once no write-back runs; a refused message stores nothing)
            m = self._migration(request.shard_map_version, request.attempt)
            m.receive(int(request.from_shard), keys, rows, state, changed)
        metrics.MIGRATED_ROWS.labels("in").inc(n)
        metrics.MIGRATED_BYTES.labels("in").inc(rows.nbytes + state.nbytes)
        if m.ready:
            self._ready.set()
        return pb.ReceiveResponse(rows=n)

    async def Seal(self, request: pb.SealRequest, context: grpc.aio.ServicerContext) -> pb.SealResponse:  # noqa: N802
        t0 = time.perf_counter()
        async with self._gate.changing():  # (after the write-backs before it, whole)
            m = self._migration(request.shard_map_version, request.attempt)
            self._still(m)
            last = m.seal() if m.changes_layout else {}
            m.sealed = True  # from here on, requests are refused until the new arrays serve
        resent = sum(k.size for k, _, _, _ in last.values())
        sizes = await asyncio.gather(*(self._send(m, d, k, w, st, c) for d, (k, w, st, c) in last.items()))
        if m.ready:
            self._ready.set()
        await asyncio.wait_for(self._ready.wait(), serving.RPC_TIMEOUT_S)
        async with self._gate.changing():  # (no lookup's copy reads the old arrays past the switch)
            if self.store.migration is not m:  # (a roll-back meanwhile rebuilt the shard from the chain)
                raise FailedPrecondition(
                    f"shard_map_version: the job rolled back while switching to {m.new_map.version}"
                )
            self.store.finish_migration()
        await self._close_peers()
        seconds = time.perf_counter() - t0
        metrics.SHARD_MAP_VERSION.set(self.store.shard_map.version)
        metrics.ROWS_HELD.set(self.store.rows_held)
        metrics.SWITCH_SECONDS.observe(seconds)
        logger.info(
            "serving shard map version %d: %d rows (%d re-sent at the switch, %.1f ms)",
            self.store.shard_map.version,
            self.store.rows_held,
            resent,
            1000 * seconds,
        )
        return pb.SealResponse(rows_resent=resent, bytes_resent=sum(sizes), seconds=seconds)

    async def AbortMigration(
        self, request: pb.AbortMigrationRequest, context: grpc.aio.ServicerContext
    ) -> pb.AbortMigrationResponse:  # noqa: N802
        """Drops the unsealed migration of ``attempt``; nothing under way at that version: nothing to do. The
        abort of another attempt to the same version (one that failed, arriving after its retry was
        prepared) is refused and leaves the attempt under way alone."""
        async with self._gate.changing():
            # (an aborted try is over here for good: its Prepare, arriving late, is refused)
            if request.attempt:
                self._attempts.add(request.attempt)
            m = self.store.migration
            if m is not None and m.new_map.version == request.shard_map_version:
                if m.attempt != request.attempt:
                    raise FailedPrecondition(
                        f"attempt: {request.attempt:x} is stale; this server's migration to version "
                        f"{m.new_map.version} is attempt {m.attempt:x}, which goes on"
                    )
                if m.sealed:
                    raise FailedPrecondition(
                        f"shard_map_version: {m.new_map.version} is sealed; it cannot be aborted"
                    )
                self._abort()
        return pb.AbortMigrationResponse()

    def _abort(self) -> None:
        self.store.abort_migration()
        peers, self._peers = self._peers, {}
        for ch in peers.values():
            asyncio.get_running_loop().create_task(ch.close())
        metrics.MIGRATION_TARGET.set(0)

    async def _close_peers(self) -> None:
        peers, self._peers = self._peers, {}
        await asyncio.gather(*(ch.close() for ch in peers.values()))
        metrics.MIGRATION_TARGET.set(0)


async def create_server(
    store: ShardStore,
    address: str = "127.0.0.1:0",
    lookup_threads: int = 0,
    servicer: EmbeddingServicer | None = None,
) -> tuple[grpc.aio.Server, int, serving.ControlServicer, HealthService]:
    """Starts a server for ``store`` (or ``servicer``'s) on ``address``; returns (server, port, control,
    health)."""
    servicer = servicer or EmbeddingServicer(store, lookup_threads)

    def counters() -> dict[str, float]:
        return {"rows_held": float(servicer.store.rows_held), "shard": float(servicer.store.shard)}

    server, port, control, health = await serving.create_server(
        address,
        "EmbeddingServer",
        lambda s: serving.add_servicer(servicer, s, pb, "EmbeddingServer", raw_requests=RAW_REQUESTS),
        counters,
        caps=request_caps(servicer.store),
    )
    metrics.ROWS_HELD.set(store.rows_held)
    metrics.SHARD_MAP_VERSION.set(store.shard_map.version)
    return server, port, control, health
