"""The DataProcessor servicer: streams numbered batches; any range can be asked for again."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator

import grpc
import numpy as np

from bagpipe import serving
from bagpipe.core.data import BatchArrays, DataFormatError, SyntheticSource, build_batch, table_offsets
from bagpipe.core.files import FileSource
from bagpipe.core.lookahead import MAX_TRAINERS, trainer_users
from bagpipe.data_processor import metrics
from bagpipe.data_processor.config import DataProcessorConfig, SourceConfig
from bagpipe.errors import InvalidArgument
from bagpipe.v1 import data_processor_pb2 as pb
from bagpipe.v1 import data_processor_pb2_grpc as pb_grpc
from bagpipe.wire import to_tensor

logger = logging.getLogger(__name__)


def generate(source: SourceConfig, batch_size: int, start: int, stride: int, end: int) -> Iterator[tuple[BatchArrays, bool]]:
    """Batches start, start+stride, ... (< end if end > 0) with their ``last`` flag."""
    offsets = table_offsets(source.table_rows)
    src = source.open()
    if isinstance(src, SyntheticSource):
        if end <= 0:
            raise InvalidArgument("end", "synthetic data is endless; give the number of batches")
        for number in range(start, end, stride):
            t0 = time.perf_counter()
            arrays = build_batch(number, src.batch(number, batch_size), offsets)
            metrics.BUILD_SECONDS.observe(time.perf_counter() - t0)
            yield arrays, number == end - 1
        return
    assert isinstance(src, FileSource)
    # this processor parses only its own batches' lines (core/files.py); last: no full batch follows
    bad_seen = 0
    t0 = time.perf_counter()
    for number, samples, last in src.numbered(batch_size, start, stride):
        if end > 0 and number >= end:
            break
        arrays = build_batch(number, samples, offsets)
        metrics.BUILD_SECONDS.observe(time.perf_counter() - t0)
        metrics.BAD_ROWS.inc(src.bad_rows - bad_seen)
        bad_seen = src.bad_rows
        yield arrays, last or number == end - 1
        t0 = time.perf_counter()


def with_users(
    batches: Iterator[tuple[BatchArrays, bool]], trainers: int
) -> Iterator[tuple[BatchArrays, np.ndarray | None, bool]]:
    """Adds each batch's per-key trainer masks when ``trainers`` > 0 (int64 on the wire: the bits of a
    uint64 mask). Timed as ``bagpipe_data_processor_trainer_mask_seconds``."""
    for arrays, last in batches:
        users: np.ndarray | None = None
        if trainers:
            t0 = time.perf_counter()
            users = trainer_users(arrays.inverse, arrays.keys.size, trainers).astype(np.uint64).view(np.int64)
            metrics.MASK_SECONDS.observe(time.perf_counter() - t0)
        yield arrays, users, last


class DataProcessorServicer(pb_grpc.DataProcessorServicer):
    def __init__(self, config: DataProcessorConfig) -> None:
        self.config = config

    async def StreamBatches(self, request: pb.StreamBatchesRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        if request.start < 0:
            raise InvalidArgument("start", f"must be >= 0, got {request.start}")
        if request.stride < 1:
            raise InvalidArgument("stride", f"must be >= 1, got {request.stride}")
        if not 0 <= request.trainers <= MAX_TRAINERS:
            raise InvalidArgument("trainers", f"must be in [0, {MAX_TRAINERS}], got {request.trainers}")
        if request.trainers and self.config.batch_size % request.trainers:
            raise InvalidArgument(
                "trainers", f"batch size {self.config.batch_size} does not split over {request.trainers} trainers"
            )
        gen = with_users(
            generate(self.config.source, self.config.batch_size, request.start, request.stride, request.end),
            request.trainers,
        )
        sentinel = object()
        while True:
            try:
                item = await asyncio.to_thread(next, gen, sentinel)
            except DataFormatError as e:
                raise InvalidArgument("data", str(e)) from e
            if item is sentinel:
                return
            arrays, users, last = item  # type: ignore[misc]
            metrics.BATCHES.inc()
            metrics.SAMPLES.inc(arrays.labels.size)
            yield pb.Batch(
                number=arrays.number,
                dense=to_tensor(arrays.dense),
                labels=to_tensor(arrays.labels),
                keys=to_tensor(arrays.keys),
                inverse=to_tensor(arrays.inverse),
                last=last,
                users=to_tensor(users) if users is not None else None,
            )


async def create_server(config: DataProcessorConfig, address: str = "127.0.0.1:0"):
    """Starts a data-processor server; returns (server, port, control, health)."""
    servicer = DataProcessorServicer(config)
    return await serving.create_server(
        address, "DataProcessor", lambda s: pb_grpc.add_DataProcessorServicer_to_server(servicer, s)
    )
