"""The trainer's transfers: plans in, rows prefetched ahead of compute, evicted rows written back.

Three threads, started by :meth:`Pipeline.start`:

* receiver — reads the oracle's plan stream (plans arrive only once their prefetch is safe);
* prefetcher — fetches the rows this trainer holds (LRPP) into the cache, in batch order, ahead of compute,
  for up to ``--transfer-batches`` plans in one call per shard, once the first of them is that many
  batches away;
* writer — writes evicted rows back and then reports the batch's write-backs durable to the oracle; it
  gathers up to ``--transfer-batches`` batches into one call per shard, and writes at once whenever the
  training thread waits for a plan (which may depend on these write-backs) or for the write-back itself.

Grouping only ever delays a fetch or a write-back, never advances one, so the oracle's rules still
hold: a plan arrives only once the write-backs it depends on are durable, and its rows cannot change on
the store before this trainer has trained the batch (they are written back only after eviction).
A Python gRPC call costs about a millisecond of CPU on each side, so fewer, larger calls leave more of
the cores to training where the services share them.

The pipeline's condition variable is also the one the synchroniser (sync.py) and the training step
wait on: every thread's progress and the first error any thread hit live here.
"""

from __future__ import annotations

import queue
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import numpy as np
import torch

from bagpipe import serving
from bagpipe.codec import decode_plans, plan_part
from bagpipe.control.registry import Registry
from bagpipe.core.plans import TrainerBatch, TrainerPlan
from bagpipe.core.row_store import RowStore
from bagpipe.trainer import metrics
from bagpipe.trainer.cache import EmbeddingCache
from bagpipe.trainer.config import TrainerConfig
from bagpipe.trainer.faults import describe
from bagpipe.v1 import oracle_cacher_pb2 as opb
from bagpipe.v1 import oracle_cacher_pb2_grpc as opb_grpc

# a plan stream is re-opened at the next batch after this long, so no call waits unboundedly
PLAN_STREAM_WINDOW_S = 60.0

# (batch, evicted keys, their rows, their state) queued for the writer
WriteBack = tuple[int, np.ndarray, torch.Tensor, torch.Tensor]
# keys -> their initial rows and zero optimizer state (EmbeddingClient.initial_of)
InitialOf = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]


# the prefetched rows are read-only views of a reply, which the cache only copies from; torch warns (once)
# that writing to a tensor on one would fail
warnings.filterwarnings("ignore", "The given NumPy array is not writable", UserWarning, __name__)


def oracle_stub(channel: grpc.Channel) -> opb_grpc.OracleCacherStub:
    """An oracle shard's stub as a trainer uses it: its plan stream yields each ``PlanPart``'s bytes,
    unparsed (``codec.plan_part`` reads them; a batch's rows stay bytes, which ``codec.decode_plans`` reads
    without a parse)."""
    stub = opb_grpc.OracleCacherStub(channel)
    service = opb.DESCRIPTOR.services_by_name["OracleCacher"]
    stub.StreamPlans = channel.unary_stream(  # (no response_deserializer: the bytes as they came)
        f"/{service.full_name}/{service.methods_by_name['StreamPlans'].name}",
        request_serializer=opb.StreamPlansRequest.SerializeToString,
    )
    return stub


class Pipeline:
    """Per-batch readiness shared by the trainer's threads, the transfer threads, and the first error."""

    def __init__(
        self,
        config: TrainerConfig,
        cache: EmbeddingCache,
        registry: Registry,
        token: list[tuple[str, str]],
        start_batch: int,
    ) -> None:
        self.config = config
        self.cache = cache
        self.registry = registry
        self.token = token  # the oracle binds this rank to this process
        self.store: RowStore | None = None
        self.oracles: list[opb_grpc.OracleCacherStub] = []  # oracle shard I's at I (--oracles)
        self.cond = threading.Condition()
        self.received: dict[int, TrainerBatch] = {}
        self.ready: set[int] = set()
        self.error: BaseException | None = None
        self.failed_in = ""  # the thread that hit it
        self.current = start_batch - 1  # the batch the training thread is on
        self.starving = False  # the training thread waits for a plan or a write-back: write back now
        self.start_batch = start_batch
        self.written_back = start_batch - 1  # last batch whose write-backs are durable
        self.transfers = {"lookup_calls": 0, "write_back_calls": 0, "first_rows": 0}
        # computes initial rows (and zero state) when every embedding server was untouched before this
        # trainer's first batch: a plan's rows used for the first time since then are computed, not fetched
        self.initial_of: InitialOf | None = None
        self._prefetch_queue: queue.Queue[TrainerBatch | None] = queue.Queue()
        self._writebacks: list[WriteBack] = []  # under cond
        self._writes_closed = False
        k, world = config.transfer_batches, config.world_size
        # trainers' groups interleave, and each one's write-backs fall between its fetches
        self._prefetch_phase = (config.rank * k) // (2 * world)
        self._write_phase = self._prefetch_phase + k // 2
        self._threads: list[threading.Thread] = []

    def connect(
        self,
        store: RowStore,
        oracles: list[opb_grpc.OracleCacherStub],
        initial_of: InitialOf | None = None,
    ) -> None:
        """``oracles``: every oracle shard's, in shard order. ``initial_of``: given only if no row of the
        store has changed since it was filled with its initial rows, checked before any trainer trained
        ``start_batch`` (the trainers' barrier follows)."""
        self.store, self.oracles, self.initial_of = store, oracles, initial_of

    def _report(self, report: opb.ProgressReport) -> None:
        """Tells every oracle shard (each releases its part of a plan on the write-backs it depends on)."""
        for oracle in self.oracles:
            oracle.ReportProgress(report, timeout=serving.RPC_TIMEOUT_S, metadata=self.token)

    # ---- shared state
    def fail(self, error: BaseException) -> None:
        with self.cond:
            if self.error is None:
                self.error = error
                self.failed_in = threading.current_thread().name
            self.cond.notify_all()

    def _thread_failed(self) -> RuntimeError:
        assert self.error is not None  # (its cause in the message: the log's one line says what it was)
        return RuntimeError(f"the trainer's {self.failed_in} thread failed: {describe(self.error)}")

    def wait(self, predicate: Callable[[], bool], starving: bool = False) -> None:
        """Waits for ``predicate``; with ``starving``, flags the wait so the writer flushes its group."""
        with self.cond:
            flagged = starving and not predicate()
            if flagged:
                self.starving = True
                self.cond.notify_all()
            try:
                self.cond.wait_for(lambda: self.error is not None or predicate())
            finally:
                if flagged:  # (only the waiter that raised the flag lowers it: another thread's wait ending
                    self.starving = False  # must not cancel the flush this one asked for)
            if self.error is not None:
                raise self._thread_failed() from self.error

    def raise_error(self) -> None:
        if self.error is not None:
            raise self._thread_failed() from self.error

    # ---- the training thread's side
    def start(self) -> None:
        self._threads = [
            threading.Thread(target=self._guarded(self._receive), name="receiver", daemon=True),
            threading.Thread(target=self._guarded(self._prefetch), name="prefetcher", daemon=True),
            threading.Thread(target=self._guarded(self._write_back), name="writer", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def next_plan(self, batch: int, timer: Any) -> TrainerBatch:
        """The plan of ``batch`` once it has arrived (``data_wait``) and its rows are cached
        (``prefetch_wait``; the no-cache baseline fetches them here)."""
        with self.cond:
            self.current = batch
            self.cond.notify_all()
        self.wait(lambda: batch in self.received, starving=True)
        timer.mark("data_wait")
        self.wait(lambda: batch in self.ready)
        with self.cond:
            plan = self.received.pop(batch)
            self.ready.discard(batch)
        if self.config.fetch == "synchronous":  # the no-cache baseline: fetch on the critical path
            self.fetch(plan.share)
        timer.mark("prefetch_wait")
        return plan

    def queue_write_back(self, batch: int, keys: np.ndarray, rows: torch.Tensor, state: torch.Tensor) -> None:
        """Hands ``batch``'s evicted rows to the writer (bounded: it keeps up with a few groups)."""
        with self.cond:
            self.cond.wait_for(
                lambda: self.error is not None or len(self._writebacks) < 4 * self.config.transfer_batches
            )
            self._writebacks.append((batch, keys, rows, state))
            self.cond.notify_all()

    def close_writes(self) -> None:
        """No more write-backs: the writer drains what is queued and ends."""
        with self.cond:
            self._writes_closed = True
            self.cond.notify_all()

    def wait_written(self, batch: int) -> None:
        """Until ``batch``'s write-backs are durable (and reported to the oracle)."""
        self.wait(lambda: self.written_back >= batch, starving=True)

    def join_writer(self) -> None:
        self._threads[2].join()

    # ---- the threads
    def _guarded(self, body: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                body()
            except BaseException as e:
                self.fail(e)

        return run

    def _receive(self) -> None:
        """Takes every batch's plan parts, one from each oracle shard (in lockstep: a batch needs all of its
        parts), with the trainer's samples from the shard that carries them (batch % K), and decodes them as
        one plan (``codec.decode_plans``)."""
        try:
            assert self.oracles
            model = self.config.model
            streams = [self._plan_parts(shard) for shard in range(len(self.oracles))]
            expected = self.start_batch
            while True:
                parts = [next(stream) for stream in streams]
                samples = parts[expected % len(parts)][1]
                assert samples is not None  # (_plan_parts checks it came)
                plan = decode_plans(
                    [(plan_msg, rows) for rows, _, plan_msg in parts],
                    samples,
                    model.num_tables,
                    model.num_dense,
                    self.config.rank,
                    self.config.world_size,
                )
                if plan.batch != expected:
                    raise ValueError(f"plan stream: expected batch {expected}, got {plan.batch}")
                with self.cond:
                    self.received[plan.batch] = plan
                    self.cond.notify_all()
                self._prefetch_queue.put(plan)
                if plan.last:
                    return
                expected += 1
        finally:
            self._prefetch_queue.put(None)

    def _plan_parts(self, shard: int) -> Iterator[tuple[opb.PlanRows | memoryview, Any, opb.Plan]]:
        """Oracle shard ``shard``'s plan stream, a batch at a time from the start batch: its rows, the
        trainer's samples (for the batches the shard carries, else None) and its plan. A stream that reached
        its deadline is opened again at the batch it did not send."""
        oracle, shards = self.oracles[shard], len(self.oracles)
        where = f"plan stream{f' of oracle shard {shard}' if shards > 1 else ''}"
        expected = self.start_batch
        while True:
            request = opb.StreamPlansRequest(rank=self.config.rank, start=expected)
            try:
                rows = samples = None  # each batch's rows and samples come just before its plan
                for part in oracle.StreamPlans(request, timeout=PLAN_STREAM_WINDOW_S, metadata=self.token):
                    kind, value = plan_part(part, where)  # (the rows stay bytes: decode_plans reads them)
                    if kind == "rows":
                        rows = value
                        continue
                    if kind == "samples":
                        samples = value
                        continue
                    if kind != "plan":
                        raise ValueError(f"{where}: after batch {expected - 1}, an empty part")
                    plan = value
                    batch = plan.batch
                    if batch != expected:
                        raise ValueError(f"{where}: expected batch {expected}, got {batch}")
                    carries = batch % shards == shard
                    came = (("rows", rows is not None), ("samples", samples is not None or not carries))
                    missing = [n for n, got in came if not got]  # (rows are bytes now: empty is not missing)
                    if missing:
                        raise ValueError(
                            f"{where}: batch {batch}'s plan came without its {' and '.join(missing)}"
                        )
                    if samples is not None and not carries:
                        raise ValueError(
                            f"{where}: batch {batch}'s samples came from shard {shard}, not from shard "
                            f"{batch % shards}, which carries them"
                        )
                    expected = batch + 1
                    yield rows, samples, plan  # type: ignore[misc]
                    if plan.last:
                        return
                    rows = samples = None
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise
                continue  # the stream's window ended: re-open it where it stopped
            raise RuntimeError(f"the oracle ended the {where} before its last plan (at batch {expected})")

    def _prefetch(self) -> None:
        group_size = self.config.transfer_batches
        pending: list[TrainerBatch] = []
        ended = False
        while pending or not ended:
            if not pending:
                plan = self._prefetch_queue.get()
                if plan is None:
                    break
                pending.append(plan)
            first = pending[0].batch
            self.wait(lambda f=first: self.current >= f - group_size)  # type: ignore[misc]
            end = self._group_end(first, self._prefetch_phase)
            while not ended and pending[-1].batch < end:  # and whatever else has arrived
                try:
                    more = self._prefetch_queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    ended = True
                else:
                    pending.append(more)
            cut = next((i for i, plan in enumerate(pending) if plan.batch > end), len(pending))
            group, pending = pending[:cut], pending[cut:]
            for plan in group:
                self.cache.ensure_capacity(plan.slot_high_water)
            if self.config.fetch == "prefetch":
                self.fetch(*(plan.share for plan in group))
                # (the servers' row tiers keep what comes next, not what was just fetched)
                self._report(
                    opb.ProgressReport(rank=self.config.rank, fetched=group[-1].batch, fetch_only=True)
                )
            with self.cond:
                self.ready.update(plan.batch for plan in group)
                self.cond.notify_all()

    def fetch(self, *shares: TrainerPlan) -> None:
        """Fetches the rows of ``shares`` (consecutive batches: their keys and slots are distinct, since a
        key or slot comes back only after a write-back that follows training the earlier batch).

        Rows the plans mark as used for the first time since this trainer's first batch are computed
        instead, when the store was untouched then (``connect``): every change to a row since then came
        from training a batch that used it, so such a row still holds its initial value."""
        assert self.store is not None
        keys = np.concatenate([share.prefetch_keys for share in shares])
        slots = np.concatenate([share.prefetch_slots for share in shares])
        if self.initial_of is not None and keys.size:
            # (marks counted from another first batch than this trainer's say nothing: fetched as usual)
            first = np.concatenate(
                [
                    s.prefetch_first if s.first_since == self.start_batch else np.zeros_like(s.prefetch_first)
                    for s in shares
                ]
            )
            if first.any():
                rows, state = self.initial_of(keys[first])
                # no-cache fetches on the training thread while the prefetcher may grow the cache: a growth
                # that swapped the tensors during a copy into the old ones would lose the rows
                with self.cache.lock.shared():
                    self.cache.insert(
                        self.cache.index(slots[first]), torch.from_numpy(rows), torch.from_numpy(state)
                    )
                self.transfers["first_rows"] += int(rows.shape[0])
                metrics.ROWS_COMPUTED.inc(int(rows.shape[0]))
                keys, slots = keys[~first], slots[~first]
        if keys.size:
            # each reply straight into the cache: one copy of the rows on this side, not two
            for positions, rows, state in self.store.lookup_parts(keys):
                with self.cache.lock.shared():
                    self.cache.insert(
                        self.cache.index(slots[positions]), torch.from_numpy(rows), torch.from_numpy(state)
                    )
            self.transfers["lookup_calls"] += 1

    def _write_back(self) -> None:
        while True:
            with self.cond:
                self.cond.wait_for(self._write_due)
                if self.error is not None:
                    return
                group, self._writebacks, closed = self._writebacks, [], self._writes_closed
                self.cond.notify_all()
            if group:
                self._write_group(group)
            if closed:
                return

    def _write_due(self) -> bool:
        """(Under the lock.) The queued write-backs reach the end of their group (they are consecutive
        batches, so at most ``--transfer-batches`` of them), or training waits, or the end."""
        if self.error is not None or self._writes_closed:
            return True
        if not self._writebacks:
            return False
        newest = self._writebacks[-1][0]
        return self.starving or newest == self._group_end(newest, self._write_phase)

    def _group_end(self, batch: int, phase: int) -> int:
        """The last batch of the transfer group holding ``batch``: groups are runs of ``--transfer-batches``
        batches shifted by ``phase``, so that the fetches and write-backs of the trainers fall on
        different iterations and their CPU is spread out rather than spent in bursts."""
        k = self.config.transfer_batches
        return batch + (k - 1 - (batch + phase) % k)

    def _write_group(self, group: list[WriteBack]) -> None:
        """Writes the evicted rows of consecutive batches back in one call per shard (an evicted key is
        not used again before its write-back, so no key appears twice), then reports them durable."""
        assert self.store is not None and self.oracles
        keys = np.concatenate([keys for _, keys, _, _ in group])
        if keys.size:
            rows = torch.cat([rows for _, _, rows, _ in group]).numpy()
            state = torch.cat([state for _, _, _, state in group]).numpy()
            self.store.write_back(keys, rows, state)
            self.transfers["write_back_calls"] += 1
        batch = group[-1][0]
        self._report(opb.ProgressReport(rank=self.config.rank, trained=batch, written_back=batch))
        with self.cond:
            self.written_back = batch
            self.cond.notify_all()
        self.registry.set_progress(self.config.rank, batch)
