"""The DataProcessor servicer: streams numbered batches; any range can be asked for again."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from typing import cast

import grpc
import numpy as np

from bagpipe import serving
from bagpipe.codec import encode_batch
from bagpipe.core.data import BatchArrays, DataFormatError
from bagpipe.core.plans import MAX_TRAINERS, trainer_users
from bagpipe.data_processor import metrics
from bagpipe.data_processor.batches import numbered_batches
from bagpipe.data_processor.config import DataProcessorConfig, SourceConfig
from bagpipe.errors import BadData, InvalidArgument
from bagpipe.v1 import data_processor_pb2 as pb
from bagpipe.v1 import data_processor_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)


def _observe(seconds: float, bad_rows: int) -> None:
    metrics.BUILD_SECONDS.observe(seconds)
    metrics.BAD_ROWS.inc(bad_rows)


def generate(
    source: SourceConfig, batch_size: int, start: int, stride: int, end: int, trainers: int
) -> Iterator[tuple[BatchArrays, bool, np.ndarray | None]]:
    """The batches a StreamBatches call asked for, with per-key trainer masks when ``trainers`` > 0
    (timed as ``bagpipe_data_processor_trainer_mask_seconds``)."""
    batches = numbered_batches(source.open(), source.table_rows, batch_size, start, stride, end, _observe)
    for arrays, last in batches:
        users = None
        if trainers:
            t0 = time.perf_counter()
            users = trainer_users(arrays.inverse, arrays.keys.size, trainers)
            metrics.MASK_SECONDS.observe(time.perf_counter() - t0)
        yield arrays, last, users


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
        gen = generate(
            self.config.source,
            self.config.batch_size,
            request.start,
            request.stride,
            request.end,
            request.trainers,
        )
        sentinel = object()
        while True:
            try:
                item = await asyncio.to_thread(next, gen, sentinel)
            except DataFormatError as e:
                raise BadData(str(e)) from e
            if item is sentinel:
                return
            arrays, last, users = cast(tuple[BatchArrays, bool, "np.ndarray | None"], item)
            metrics.BATCHES.inc()
            metrics.SAMPLES.inc(arrays.labels.size)
            for part in encode_batch(arrays, last, users, request.slices):
                yield part


async def create_server(config: DataProcessorConfig, address: str = "127.0.0.1:0"):
    """Starts a data-processor server; returns (server, port, control, health)."""
    servicer = DataProcessorServicer(config)
    return await serving.create_server(
        address,
        "DataProcessor",
        lambda s: serving.add_servicer(servicer, s, pb, "DataProcessor"),  # parts go out as encoded
    )
