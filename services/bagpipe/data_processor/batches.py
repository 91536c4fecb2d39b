"""Numbered global batches from any source: what a data processor serves and the plan statistics replay.

Batch ``b`` is samples ``[b*B, (b+1)*B)`` of the source's stream, whatever the number of processors,
trainers or servers; a processor serving every ``stride``-th batch from ``start`` gets exactly those.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from bagpipe.core.data import BatchArrays, SyntheticSource, build_batch, table_offsets
from bagpipe.data_processor.files import FileSource

# called once per batch with the seconds it took to read and build, and the malformed lines it skipped
Observer = Callable[[float, int], Any]


def numbered_batches(
    source: SyntheticSource | FileSource,
    table_rows: tuple[int, ...] | list[int],
    batch_size: int,
    start: int,
    stride: int,
    end: int,
    observe: Observer | None = None,
) -> Iterator[tuple[BatchArrays, bool]]:
    """Batches ``start, start+stride, ...`` (``< end`` when ``end > 0``), each with its ``last`` flag
    (no full batch follows it). Synthetic data is endless, so it needs ``end > 0``."""
    offsets = table_offsets(table_rows)
    if isinstance(source, SyntheticSource):
        if end <= 0:
            raise ValueError("end: synthetic data is endless; give the number of batches")
        for number in range(start, end, stride):
            t0 = time.perf_counter()
            arrays = build_batch(number, source.batch(number, batch_size), offsets)
            if observe is not None:
                observe(time.perf_counter() - t0, 0)
            yield arrays, number == end - 1
        return
    # a file source parses only this stride's lines (files.py)
    bad_seen = 0
    t0 = time.perf_counter()
    for number, samples, last in source.numbered(batch_size, start, stride):
        if end > 0 and number >= end:
            break
        arrays = build_batch(number, samples, offsets)
        if observe is not None:
            observe(time.perf_counter() - t0, source.bad_rows - bad_seen)
        bad_seen = source.bad_rows
        yield arrays, last or number == end - 1
        t0 = time.perf_counter()
