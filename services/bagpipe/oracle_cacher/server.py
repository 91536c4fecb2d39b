"""The OracleCacher servicer: reorders batches, plans them, and dispatches plans to trainers.

(Over 400 lines: the readers, the planner and the plan streams share one loop and one condition,
and are kept in one class.)

Three kinds of tasks share one asyncio loop: one reader per data processor (each streams every
N-th batch), one planner, and one StreamPlans call per trainer. A plan for batch x is released only
when every trainer has reported the write-backs of batch x-L durable (DESIGN.md rule 1; see
``oracle_cacher/lookahead.py`` for why x-L is the bound with a window of L batches).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hmac
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import grpc
import numpy as np

from bagpipe import security, serving
from bagpipe.codec import EncodedPlan, WireBatch, check_samples, decode_batch, encode_plans
from bagpipe.core.data import table_offsets
from bagpipe.core.oracle_shards import KeyShards, shard_capacity
from bagpipe.core.plans import BACKGROUND, CRITICAL, every_trainer, mask_dtype
from bagpipe.errors import BAD_DATA, BadData, InvalidArgument, PermissionDenied
from bagpipe.oracle_cacher import metrics
from bagpipe.oracle_cacher.config import OracleConfig
from bagpipe.oracle_cacher.lookahead import LookaheadPlanner
from bagpipe.v1 import data_processor_pb2
from bagpipe.v1 import oracle_cacher_pb2 as pb
from bagpipe.v1 import oracle_cacher_pb2_grpc as pb_grpc
from bagpipe.wire import to_tensor

logger = logging.getLogger(__name__)

TRAINER_KEY = security.TRAINER_KEY


@dataclass
class _Received:
    batch: WireBatch
    users: np.ndarray
    samples: list[bytes]  # every trainer's Samples part, as the data processor sent it (codec.check_samples)


@dataclass
class _Planned:
    """A planned batch waiting for its trainers: its messages, and what dispatching it needs of its plan
    (the plan's arrays are dropped once serialised: up to L + 2 batches wait here)."""

    depends_on: int  # the newest batch whose write-backs must be durable before it is sent
    last: bool
    encoded: EncodedPlan  # the rows, serialised once, every trainer's samples and Plan (codec.encode_plans)
    taken: set[int] = field(default_factory=set)


class Oracle(pb_grpc.OracleCacherServicer):
    """Planning state and the two RPCs trainers call."""

    def __init__(self, config: OracleConfig, planner: LookaheadPlanner | None = None) -> None:
        """``planner``: one of the same config's, reset (a rewind reuses the last generation's)."""
        self.config = config
        self.num_keys = int(table_offsets(config.table_rows)[-1])
        # one of K oracle shards plans its keys alone, numbered by their local rows (core/oracle_shards.py)
        self.shards = KeyShards(self.num_keys, config.oracles) if config.oracles > 1 else None
        if self.shards is not None:
            self.num_keys = self.shards.rows(config.shard)
        self.planner = planner or LookaheadPlanner(
            self.num_keys,
            config.window,
            trainers=config.trainers,
            capacity=shard_capacity(config.cache_rows, config.oracles, config.shard),
            reuse_delay=config.reuse_delay,
            delayed_sync=config.delayed_sync,
            threads=config.planner_threads,
            shard=None if self.shards is None else (self.shards, config.shard),  # (plans in global terms)
        )
        self.received: dict[int, _Received] = {}
        self.planned: dict[int, _Planned] = {}
        # plans every trainer has taken, kept until every trainer has trained them: a trainer whose plan
        # stream reached its deadline mid-message re-opens it at the batch it did not get
        self.sent: dict[int, _Planned] = {}
        self.written_back = [config.start_batch - 1] * config.trainers
        # a rank belongs to the trainer process that first called for it (its token, call metadata
        # bagpipe-trainer): another client cannot take its plans or report its progress
        self.owners: dict[int, str] = {}
        self.dispatched = [config.start_batch - 1] * config.trainers  # the last plan each rank was sent
        self.trained = [config.start_batch - 1] * config.trainers
        self.fetched = [config.start_batch - 1] * config.trainers  # (the fetch streams tell its minimum)
        # every planned batch's fetched keys and whether it is the last, until every trainer trained it (the
        # embedding servers' fetch streams)
        self.fetches: dict[int, tuple[np.ndarray, bool]] = {}
        self.cond = asyncio.Condition()
        self.readers_done = 0
        self.failure: str | None = None
        self.next_push = config.start_batch
        self.plan_buffer = config.window + 2
        self.windows: list[int] = []
        self.early_reuses = 0
        # told which processor's stream failed, and why (the controller blames it, not the trainers)
        self.on_processor_failure: Callable[[str, str], Awaitable[None]] | None = None
        metrics.LOOKAHEAD.set(config.window)
        metrics.ITERATIONS_TARGET.set(config.iterations)

    # ---- data processors -> oracle
    async def read_processor(self, address: str, offset: int, stride: int) -> None:
        """Streams batches offset, offset+stride, ... (from the start batch on) into the reorder buffer,
        with back-pressure: a processor runs ahead of the buffer by one stream window at most."""
        end = self.config.iterations
        first = self.config.start_batch
        offset = first + (offset - first) % stride
        async with serving.aio_channel(address, serving.FIXED_WINDOW) as ch:
            # the stream's parts as bytes: the samples go on to the trainers as they came
            stream_batches = ch.unary_stream(
                "/bagpipe.v1.DataProcessor/StreamBatches",
                request_serializer=data_processor_pb2.StreamBatchesRequest.SerializeToString,
                response_deserializer=None,
            )
            # with LRPP the processors also work out which trainers use each key (off the single oracle)
            trainers = self.config.trainers if self.config.cache_mode == "lrpp" else 0
            # and cut every batch's samples per trainer, which go to the trainers as they come (raw bytes)
            slices = self.config.trainers
            request = data_processor_pb2.StreamBatchesRequest(
                start=offset, stride=stride, end=end, trainers=trainers, slices=slices
            )
            if self.shards is not None:  # (its keys of every batch; the samples of those it carries)
                request.oracles, request.shard = self.config.oracles, self.config.shard
            size = self.config.batch_size // slices
            batch: WireBatch | None = None
            samples: list[bytes] = []
            async for data in stream_batches(request):
                if batch is None:
                    part = data_processor_pb2.BatchPart.FromString(data)
                    if part.WhichOneof("part") != "batch":
                        raise InvalidArgument(
                            f"stream from batch {offset}",
                            f"expected a batch, got {part.WhichOneof('part') or 'an empty part'}",
                        )
                    batch = decode_batch(
                        part.batch,
                        num_keys=self.num_keys,
                        batch_size=self.config.batch_size,
                        num_tables=len(self.config.table_rows),
                        trainers=self.config.trainers,
                        slices=slices,
                    )
                    if self.carries(batch.number):
                        continue
                else:
                    samples.append(check_samples(data, batch.number, len(samples), size))
                    if len(samples) < slices:
                        continue
                users = self._users(batch)
                received = _Received(batch, users, samples)
                batch, samples = None, []
                async with self.cond:
                    cap = 2 * stride + 4  # batches read ahead of the window
                    await self.cond.wait_for(functools.partial(self._room_for, received.batch.number, cap))
                    self.received[received.batch.number] = received
                    metrics.BATCHES_RECEIVED.inc()
                    self.cond.notify_all()
            if batch is not None:
                raise InvalidArgument(
                    f"batch {batch.number}: samples", f"the stream ended after {len(samples)} of {slices}"
                )

    def carries(self, batch: int) -> bool:
        """Whether this oracle sends the trainers ``batch``'s samples: shard ``batch % K`` of K does."""
        return batch % self.config.oracles == self.config.shard

    def _room_for(self, number: int, ahead: int) -> bool:
        return number < self.next_push + ahead or self.failure is not None

    def _ready_to_send(self, batch: int) -> bool:
        return self.failure is not None or self._dispatchable(batch)

    def _users(self, batch: WireBatch) -> np.ndarray:
        """Which trainers use each key (every trainer, for a replicated cache)."""
        unique = batch.keys.size
        if self.config.cache_mode == "replicated":
            return every_trainer(unique, self.config.trainers)
        if batch.users is None:  # asked for (with LRPP), so a processor that predates the field
            raise InvalidArgument(f"batch {batch.number}: users", "missing: the data processor sent no masks")
        return batch.users.astype(mask_dtype(self.config.trainers), copy=False)  # (decode_batch's: no copy)

    async def run_readers(self, addresses: list[str]) -> None:
        async def one(i: int, addr: str) -> None:
            try:
                await self.read_processor(addr, i, len(addresses))
            except Exception as e:  # a failed input makes the job fail loudly, not hang
                logger.exception("data processor %s failed", addr)
                async with self.cond:
                    self.failure = f"data processor {addr}: {e}"
                    self.cond.notify_all()
                if self.on_processor_failure is not None and not isinstance(e, asyncio.CancelledError):
                    await self.on_processor_failure(addr, _reason(e))
            finally:
                async with self.cond:
                    self.readers_done += 1
                    self.cond.notify_all()

        await asyncio.gather(*(one(i, a) for i, a in enumerate(addresses)))

    def start(self, processor_addresses: list[str]) -> list[asyncio.Task[None]]:
        """Starts the readers and the planner; a crash in either fails the job's plan streams."""
        tasks = [
            asyncio.create_task(self.run_readers(processor_addresses), name="readers"),
            asyncio.create_task(self.run_planner(), name="planner"),
        ]
        for task in tasks:
            task.add_done_callback(self._on_task_done)
        return tasks

    def _on_task_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or task.exception() is None:
            return
        logger.error("oracle task %s failed", task.get_name(), exc_info=task.exception())
        self.failure = f"oracle {task.get_name()} failed: {task.exception()}"

        async def wake() -> None:
            async with self.cond:
                self.cond.notify_all()

        asyncio.get_running_loop().create_task(wake())

    # ---- planning
    def _work_ready(self) -> bool:
        if self.failure is not None:
            return True
        if len(self.planned) >= self.plan_buffer:
            return False
        if self.planner.can_pop():
            return True
        if self.planner.wants_more() and self.next_push in self.received:
            return True
        return self.readers_done == self.config.data_processors and self.planner.wants_more()

    async def run_planner(self) -> None:
        while True:
            async with self.cond:
                await self.cond.wait_for(self._work_ready)
                if self.failure is not None:
                    return
                while self.planner.wants_more() and self.next_push in self.received:
                    item = self.received[self.next_push]
                    if not self.planner.push(
                        self.next_push, item.batch.keys, last=item.batch.last, users=item.users
                    ):
                        break  # the cache cannot hold it next to the window: plan the oldest first
                    self.next_push += 1
                if self.planner.wants_more() and self.readers_done == self.config.data_processors:
                    if self.planner.window_size == 0:
                        self.failure = f"the data ended before batch {self.next_push}"
                        self.cond.notify_all()
                        return
                    self.planner.finish()
                if not self.planner.can_pop():
                    continue
                t0 = time.perf_counter()
                plan = self.planner.pop()
                source = self.received.pop(plan.batch)
                checkpoint = self.config.checkpoint_after(plan.batch) and not plan.last
                cached = self.planner.cached() if checkpoint else None
                # (with LRPP the trainers take their rows from their samples: no masks of the batch's rows)
                encoded = encode_plans(
                    plan,
                    source.samples,
                    self.config.batch_size,
                    cached,
                    self.config.trainers,
                    users=self.config.cache_mode == "replicated",
                )
                metrics.PLAN_SECONDS.observe(time.perf_counter() - t0)
                metrics.PLAN_BYTES.inc(encoded.nbytes)
                metrics.BATCHES_PLANNED.inc()
                metrics.OCCUPANCY.set(plan.occupancy)
                metrics.LOOKAHEAD.set(plan.window)
                metrics.PEAK_OCCUPANCY.set(self.planner.peak_occupancy)
                metrics.SLOT_HIGH_WATER.set(plan.slot_high_water)
                rows = np.bincount(plan.sync_class, minlength=3)
                handed = int(plan.handovers.critical.sum())
                metrics.ROWS_SYNCED.labels("critical").inc(int(rows[CRITICAL]) + handed)
                metrics.ROWS_SYNCED.labels("background").inc(
                    int(rows[BACKGROUND]) + plan.handovers.critical.size - handed
                )
                if self.planner.early_reuses > self.early_reuses:
                    metrics.EARLY_REUSES.inc(self.planner.early_reuses - self.early_reuses)
                    self.early_reuses = self.planner.early_reuses
                self.windows.append(plan.window)
                self.planned[plan.batch] = _Planned(plan.depends_on, plan.last, encoded)
                self.fetches[plan.batch] = (plan.prefetch_keys, plan.last)
                self._update_queue_metrics()
                self.cond.notify_all()
                if plan.last:
                    logger.info(
                        "planned the last batch %d; L %d..%d, peak occupancy %d rows, %d slots",
                        plan.batch,
                        self.planner.min_window,
                        max(self.windows),
                        self.planner.peak_occupancy,
                        self.planner.trainer_slot_high_water,
                    )
                    return

    def _update_queue_metrics(self) -> None:
        for rank in range(self.config.trainers):
            waiting = sum(1 for entry in self.planned.values() if rank not in entry.taken)
            metrics.QUEUE_DEPTH.labels(str(rank)).set(waiting)
        metrics.READY_PLANS.set(sum(1 for b in self.planned if self._dispatchable(b)))

    # ---- oracle -> trainers
    def _entry(self, batch: int) -> _Planned | None:
        return self.planned.get(batch) or self.sent.get(batch)

    def _dispatchable(self, batch: int) -> bool:
        entry = self._entry(batch)
        return entry is not None and min(self.written_back) >= entry.depends_on

    async def StreamPlans(self, request: pb.StreamPlansRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        rank = request.rank
        if not 0 <= rank < self.config.trainers:
            raise InvalidArgument("rank", f"must be in [0, {self.config.trainers}), got {rank}")
        self._bind(rank, context)
        batch = request.start
        if batch < self.config.start_batch:
            raise InvalidArgument(
                "start", f"this oracle plans from batch {self.config.start_batch}, asked for {batch}"
            )
        while True:
            async with self.cond:
                await self.cond.wait_for(functools.partial(self._ready_to_send, batch))
                if self.failure is not None:
                    await context.abort(grpc.StatusCode.ABORTED, self.failure)
                entry = self._entry(batch)
                assert entry is not None
                entry.taken.add(rank)
                if len(entry.taken) == self.config.trainers and batch in self.planned:
                    self.sent[batch] = self.planned.pop(batch)
                    self.cond.notify_all()
                self._update_queue_metrics()
            metrics.PLANS_DISPATCHED.inc()
            if batch > self.dispatched[rank]:
                async with self.cond:  # (the fetch streams tell it)
                    self.dispatched[rank] = batch
                    self.cond.notify_all()
            yield entry.encoded.rows  # the same bytes on every trainer's stream
            if entry.encoded.samples:  # (an oracle shard sends the samples of the batches it carries)
                yield entry.encoded.samples[rank]  # as the data processor sent them
            yield entry.encoded.plans[rank]
            if entry.last:
                return
            batch += 1

    async def ReportProgress(
        self, request: pb.ProgressReport, context: grpc.aio.ServicerContext
    ) -> pb.ProgressAck:  # noqa: N802
        rank = request.rank
        if not 0 <= rank < self.config.trainers:
            raise InvalidArgument("rank", f"must be in [0, {self.config.trainers}), got {rank}")
        self._bind(rank, context)
        if request.fetch_only:  # (the prefetcher's: only how far this trainer has fetched)
            if request.fetched > self.dispatched[rank]:
                raise InvalidArgument(
                    "fetched",
                    f"rank {rank} fetched batch {request.fetched}, but was sent plans up to "
                    f"{self.dispatched[rank]} only",
                )
            async with self.cond:
                self.fetched[rank] = max(self.fetched[rank], request.fetched)
                self.cond.notify_all()
            return pb.ProgressAck()
        for name, value, now in (
            ("written_back", request.written_back, self.written_back[rank]),
            ("trained", request.trained, self.trained[rank]),
        ):
            if value > self.dispatched[rank]:
                raise InvalidArgument(
                    name,
                    f"rank {rank} reports batch {value}, but was sent plans up to "
                    f"{self.dispatched[rank]} only",
                )
            if value < now:
                raise InvalidArgument(
                    name, f"rank {rank} reports batch {value}, after {now}: progress only moves on"
                )
        async with self.cond:
            self.written_back[rank] = request.written_back
            self.trained[rank] = request.trained
            for done in [b for b in self.sent if b <= min(self.trained)]:
                del self.sent[done]
            for done in [b for b in self.fetches if b <= min(self.trained)]:
                del self.fetches[done]
            self._update_queue_metrics()
            self.cond.notify_all()
        return pb.ProgressAck()

    async def StreamFetches(  # noqa: N802
        self, request: pb.StreamFetchesRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.Fetches]:
        """Every planned batch's fetched keys, in order from ``start`` (or from the oldest still kept: the
        batches before it are trained), as soon as it is planned, and each move of the trainers' progress."""
        batch = max(request.start, self.config.start_batch)
        told = (-2, -2, -2)  # the progress last sent: trained, dispatched, fetched

        def news() -> bool:
            return (
                self.failure is not None
                or batch in self.fetches
                or self._progress() != told
                or (bool(self.fetches) and batch < min(self.fetches))
            )

        while True:
            async with self.cond:
                await self.cond.wait_for(news)
                if self.failure is not None:
                    await context.abort(grpc.StatusCode.ABORTED, self.failure)
                if self.fetches and batch < min(self.fetches) and batch not in self.fetches:
                    batch = min(self.fetches)  # (trained already: nobody fetches it any more)
                found = self.fetches.get(batch)
                told = self._progress()
            message = pb.Fetches(batch=-1, trained=told[0], dispatched=told[1], fetched=told[2])
            if found is None:
                yield message
                continue
            keys, last = found
            message.batch, message.last = batch, last
            message.keys.CopyFrom(to_tensor(keys))
            yield message
            if last:
                return
            batch += 1

    def _progress(self) -> tuple[int, int, int]:
        """The last batch every trainer has trained, been sent and fetched."""
        return min(self.trained), min(self.dispatched), min(self.fetched)

    def _bind(self, rank: int, context: grpc.aio.ServicerContext) -> None:
        token = next((v for k, v in context.invocation_metadata() or () if k == TRAINER_KEY), "")
        owner = self.owners.setdefault(rank, str(token))
        if not hmac.compare_digest(owner.encode(), str(token).encode()):
            raise PermissionDenied(f"rank: rank {rank} belongs to another trainer process")

    def counters(self) -> dict[str, float]:
        return {
            "next_batch": float(self.next_push),
            "lookahead": float(self.windows[-1] if self.windows else self.config.window),
            "min_lookahead": float(self.planner.min_window),
            "peak_occupancy": float(self.planner.peak_occupancy),
            "slot_high_water": float(self.planner.trainer_slot_high_water),  # (as the metric: a plan's)
            "min_written_back": float(min(self.written_back)),
        }


def _reason(error: BaseException) -> str:
    """A processor's own message (``file:line: field ...``), not the gRPC error's wrapping; its input's
    fault is marked as bad data (``errors.BAD_DATA``)."""
    if isinstance(error, grpc.RpcError) and error.details():
        details = error.details()
        if error.code() == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(BadData.PREFIX):
            return BAD_DATA + details.removeprefix(BadData.PREFIX)
        return f"{error.code().name}: {details}"
    return str(error)


class Rewinding(pb_grpc.OracleCacherServicer):
    """The servicer the oracle's server keeps while the job's generations come and go: each generation
    plans anew from its start batch in an ``Oracle`` of its own (control/generation.py), and every call
    goes to the one in force. A past generation's plan streams end (ABORTED)."""

    def __init__(self, config: OracleConfig) -> None:
        self.config = config
        self.oracle = Oracle(config)
        self.tasks: list[asyncio.Task[None]] = []

    async def rewind(
        self,
        start_batch: int,
        processors: list[str],
        on_processor_failure: Callable[[str, str], Awaitable[None]] | None = None,
    ) -> None:
        """Plans again from ``start_batch``, reading ``processors``."""
        old, tasks = self.oracle, self.tasks
        for task in tasks:
            task.cancel()
        async with old.cond:
            old.failure = f"the job rolled back to batch {start_batch}"
            old.cond.notify_all()
        await asyncio.gather(*tasks, return_exceptions=True)  # (then nothing uses its planner)
        await asyncio.to_thread(old.planner.reset)
        self.oracle = Oracle(dataclasses.replace(self.config, start_batch=start_batch), old.planner)
        self.oracle.on_processor_failure = on_processor_failure
        self.tasks = self.oracle.start(processors)

    def StreamPlans(self, request: pb.StreamPlansRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        return self.oracle.StreamPlans(request, context)

    def ReportProgress(self, request: pb.ProgressReport, context: grpc.aio.ServicerContext):  # noqa: N802
        return self.oracle.ReportProgress(request, context)

    def StreamFetches(self, request: pb.StreamFetchesRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        return self.oracle.StreamFetches(request, context)

    def counters(self) -> dict[str, float]:
        return self.oracle.counters()

    def stop(self) -> None:
        for task in self.tasks:
            task.cancel()


async def create_server(oracle: Oracle | Rewinding, address: str = "127.0.0.1:0"):
    """Starts the oracle's server; returns (server, port, control, health)."""
    return await serving.create_server(
        address,
        "OracleCacher",
        lambda s: serving.add_servicer(oracle, s, pb, "OracleCacher"),  # plans go out as encoded
        oracle.counters,
    )
