"""The DataProcessor servicer: streams numbered batches; any range can be asked for again."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Generator, Iterator
from typing import cast

import grpc
import numpy as np

from bagpipe import serving
from bagpipe.codec import encode_batch
from bagpipe.core.data import BatchArrays, DataFormatError, table_offsets
from bagpipe.core.oracle_shards import KeyShards, Split
from bagpipe.core.plans import MAX_TRAINERS, trainer_users
from bagpipe.data_processor import metrics
from bagpipe.data_processor.batches import numbered_batches
from bagpipe.data_processor.config import DataProcessorConfig, SourceConfig
from bagpipe.data_processor.sharing import BuildRegistry, Built, shared_stream
from bagpipe.errors import BadData, InvalidArgument
from bagpipe.v1 import data_processor_pb2 as pb
from bagpipe.v1 import data_processor_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)


def _observe(seconds: float, bad_rows: int) -> None:
    metrics.BUILD_SECONDS.observe(seconds)
    metrics.BAD_ROWS.inc(bad_rows)


def oracle_part(
    arrays: BatchArrays, users: np.ndarray | None, shards: KeyShards, shard: int, split: Split | None = None
) -> tuple[BatchArrays, np.ndarray | None, bool]:
    """Oracle shard ``shard``'s part of a batch (``core/oracle_shards.py``): its keys as its local rows,
    sorted, with their masks, and whether it carries the batch's samples (number % shards == shard), whose
    inverse then indexes the batch's keys in shard order. ``split``: the batch's keys split by shard, when
    made already (``KeyShards.split``)."""
    split = shards.split(arrays.keys) if split is None else split
    mine = split.part(shard)
    carries = arrays.number % shards.shards == shard
    inverse = split.inverse(arrays.inverse) if carries else arrays.inverse
    part = dataclasses.replace(arrays, keys=split.local[mine], inverse=inverse)
    return part, (users[mine] if users is not None else None), carries


def built_batches(
    source: SourceConfig, batch_size: int, start: int, stride: int, end: int, trainers: int
) -> Iterator[tuple[BatchArrays, bool, np.ndarray | None]]:
    """The batches a StreamBatches call asked for, each with its ``last`` flag and, when ``trainers`` > 0,
    its keys' trainer masks (timed as ``bagpipe_data_processor_trainer_mask_seconds``)."""
    batches = numbered_batches(source.open(), source.table_rows, batch_size, start, stride, end, _observe)
    for arrays, last in batches:
        users = None
        if trainers:
            t0 = time.perf_counter()
            users = trainer_users(arrays.inverse, arrays.keys.size, trainers)
            metrics.MASK_SECONDS.observe(time.perf_counter() - t0)
        yield arrays, last, users


def generate(
    source: SourceConfig, batch_size: int, start: int, stride: int, end: int, trainers: int
) -> Generator[tuple[BatchArrays, bool, np.ndarray | None, bool]]:
    """``built_batches`` for one oracle, which takes every batch's samples."""
    for arrays, last, users in built_batches(source, batch_size, start, stride, end, trainers):
        yield arrays, last, users, True


class DataProcessorServicer(pb_grpc.DataProcessorServicer):
    def __init__(self, config: DataProcessorConfig) -> None:
        self.config = config
        self._key_shards: dict[int, KeyShards] = {}
        self.builds = BuildRegistry()  # the oracle shards' streams share one build of each batch

    def shard_stream(
        self, request: pb.StreamBatchesRequest, shards: KeyShards
    ) -> Generator[tuple[BatchArrays, bool, np.ndarray | None, bool]]:
        """Oracle shard ``request.shard``'s part of each batch it asked for, from one build of each batch
        for the K shards' streams of the same request (``sharing.py``)."""
        config = self.config

        def builder(start: int) -> Iterator[Built]:
            batches = built_batches(
                config.source, config.batch_size, start, request.stride, request.end, request.trainers
            )
            for arrays, last, users in batches:
                yield Built(arrays, last, users, shards.split(arrays.keys))

        key = (request.start, request.stride, request.end, request.trainers, request.oracles)
        for built, mine in shared_stream(self.builds, key, request.start, request.stride, builder):
            if not mine:
                metrics.SHARED.inc()
            arrays, users, carries = oracle_part(
                built.arrays, built.users, shards, request.shard, built.split
            )
            yield arrays, built.last, users, carries

    def key_shards(self, oracles: int) -> KeyShards:
        """The key map of ``oracles`` oracle shards over the source's keys (made once per count)."""
        if oracles not in self._key_shards:
            num_keys = int(table_offsets(self.config.source.table_rows)[-1])
            self._key_shards[oracles] = KeyShards(num_keys, oracles)
        return self._key_shards[oracles]

    async def StreamBatches(self, request: pb.StreamBatchesRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        if request.start < 0:
            raise InvalidArgument("start", f"must be >= 0, got {request.start}")
        if request.stride < 1:
            raise InvalidArgument("stride", f"must be >= 1, got {request.stride}")
        if not 0 <= request.trainers <= MAX_TRAINERS:
            raise InvalidArgument("trainers", f"must be in [0, {MAX_TRAINERS}], got {request.trainers}")
        if request.end <= 0 and self.config.source.data == "synthetic":
            raise InvalidArgument("end", "synthetic data is endless; give the number of batches")
        if request.trainers and self.config.batch_size % request.trainers:
            raise InvalidArgument(
                "trainers",
                f"batch size {self.config.batch_size} does not split over {request.trainers} trainers",
            )
        if not 0 <= request.slices <= MAX_TRAINERS:
            raise InvalidArgument("slices", f"must be in [0, {MAX_TRAINERS}], got {request.slices}")
        if request.slices and self.config.batch_size % request.slices:
            raise InvalidArgument(
                "slices", f"batch size {self.config.batch_size} does not split into {request.slices} slices"
            )
        if request.oracles > 1:
            if not 0 <= request.shard < request.oracles:
                raise InvalidArgument("shard", f"must be in [0, {request.oracles}), got {request.shard}")
            if not request.slices:
                raise InvalidArgument("slices", "oracle shards take the samples in slices: give slices > 0")
        if request.oracles > 1:
            gen = self.shard_stream(request, self.key_shards(request.oracles))
        else:
            gen = generate(
                self.config.source,
                self.config.batch_size,
                request.start,
                request.stride,
                request.end,
                request.trainers,
            )
        sentinel = object()
        try:
            while True:
                try:
                    item = await asyncio.to_thread(next, gen, sentinel)
                except DataFormatError as e:
                    raise BadData(str(e)) from e
                if item is sentinel:
                    return
                arrays, last, users, carries = cast(tuple[BatchArrays, bool, "np.ndarray | None", bool], item)
                metrics.BATCHES.inc()
                metrics.SAMPLES.inc(arrays.labels.size)
                for part in encode_batch(arrays, last, users, request.slices, carries):
                    yield part
        finally:  # (a shard's stream leaves its group of builds now, not when collected)
            with contextlib.suppress(ValueError):  # (still running in its thread: it leaves when collected)
                gen.close()


async def create_server(config: DataProcessorConfig, address: str = "127.0.0.1:0"):
    """Starts a data-processor server; returns (server, port, control, health)."""
    servicer = DataProcessorServicer(config)
    return await serving.create_server(
        address,
        "DataProcessor",
        lambda s: serving.add_servicer(servicer, s, pb, "DataProcessor"),  # parts go out as encoded
    )
