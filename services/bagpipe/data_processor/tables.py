"""csv:, tsv: and parquet: files laid out as a ``Schema`` (``core/schema.py``), read with pyarrow.

The files are one stream of samples, numbered, split between data processors and shuffled exactly as
the Criteo and Avazu files are (``FileSource.numbered``); what differs is how a block of rows becomes
samples. pyarrow reads a block (a CSV block of ``CHUNK_BYTES``, or a Parquet batch of ``PARQUET_ROWS``
rows), and each column is converted at once:

* the label must be 0 or 1;
* a dense value is a number (CSV text is checked against a number's pattern first, so that a bad one is
  named by its row), transformed as the schema says; missing is 0;
* a categorical value becomes a row: ``hash`` runs FNV-1a-64 over the value's text (Avazu's compiled
  kernel over Arrow's string buffer), ``mod`` takes an integer modulo the rows, ``none`` checks that the
  integer is a row, ``hex`` reads hexadecimal text (Criteo's); missing is row 0.

A value that fails names its file, line (CSV; the header is line 1) or row (Parquet, from 1), column and
text, or with ``skip_bad_rows`` its row is counted and dropped. A Parquet row group of which this
processor needs no sample is passed over from the file's metadata, unread.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from bagpipe.core.data import DataFormatError, Samples
from bagpipe.core.schema import Column, Schema
from bagpipe.data_processor.files import (
    CHUNK_BYTES,
    FileConfig,
    FileSource,
    _fnv_rows,
    _hex_rows,
    _slice,
    runs_of,
)

logger = logging.getLogger(__name__)

PARQUET_ROWS = 1 << 16  # rows of a Parquet file converted at a time
_FLOAT = r"^[-+]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?$|^[-+]?(?i:nan|inf|infinity)$"
_INT = r"^-?[0-9]{1,18}$"
_FLOAT64 = pa.float64()


class TableSource(FileSource):
    """Numbered batches of csv, tsv or parquet files (``kind``) laid out as ``schema``, whose categorical
    columns carry their tables' sizes."""

    def __init__(self, config: FileConfig, schema: Schema, kind: str) -> None:
        super().__init__(config)
        if schema.table_rows is None:
            raise ValueError(f"table_rows: the schema {schema.source} gives no rows for some tables")
        self.schema, self.kind = schema, kind
        self.num_dense = schema.num_dense
        self.rows = np.asarray(schema.table_rows, dtype=np.int64)
        self._read = sorted({c.reads for c in schema.columns if c.role != "ignore"})

    def check_head(self) -> None:
        """Converts the first block of every file, as its batches would be."""
        for path in self.config.paths:
            for first, _, load in self._blocks(path):
                self._samples(path, first, load())
                break

    def _stream(
        self, wanted: Callable[[int, int], list[tuple[int, int]]]
    ) -> Iterator[tuple[int, int, Samples | None]]:
        """As ``FileSource._stream``: ``(first, count, samples)`` runs of the sample stream, ``samples``
        None where ``wanted`` leaves them out. Without skip_bad_rows a row is a sample, so a block of which
        nothing is wanted is not converted (a Parquet one not even read)."""
        self.bad_rows = self.samples_read = 0
        position = 0
        for path in self.config.paths:
            seen, skipped = False, self.bad_rows
            for first_row, count, load in self._blocks(path):
                samples: Samples | None = None
                if self.config.skip_bad_rows:
                    samples = self._samples(path, first_row, load())
                    n, runs = len(samples), wanted(position, len(samples))
                else:
                    n, runs = count, wanted(position, count)
                    if runs:
                        samples = self._samples(path, first_row, load())
                seen = seen or n > 0
                if samples is None:  # (nothing of it wanted)
                    if n:
                        yield position, n, None
                else:
                    yield from runs_of(position, n, runs, functools.partial(_slice, samples))
                position += n
                self.samples_read = position
            if not seen and self.bad_rows == skipped:
                raise DataFormatError(path, 0, "file", "", "is empty: no samples")

    # -- reading
    def _blocks(self, path: str) -> Iterator[tuple[int, int, Callable[[], pa.RecordBatch]]]:
        """(index of its first row in the file, rows, its loader) of each block of one file; CSV's rows
        are only known once read, Parquet's from the metadata."""
        if self.kind == "parquet":
            yield from self._parquet_blocks(path)
            return
        first = 0
        for batch in self._csv_reader(path):
            yield first, batch.num_rows, functools.partial(_same, batch)
            first += batch.num_rows

    def _parquet_blocks(self, path: str) -> Iterator[tuple[int, int, Callable[[], pa.RecordBatch]]]:
        import pyarrow.parquet as pq

        try:
            f = pq.ParquetFile(path)
        except (pa.ArrowException, OSError) as e:
            raise DataFormatError(path, 0, "file", "", f"is not a Parquet file ({e})") from None
        missing = sorted(set(self._read) - set(f.schema_arrow.names))
        if missing:
            raise DataFormatError(
                path, 0, "columns", ",".join(f.schema_arrow.names), f"lack {', '.join(missing)}"
            )
        first = 0
        read: dict[int, pa.Table] = {}  # (the row group last read: its blocks share one read)
        for group in range(f.metadata.num_row_groups):
            total = f.metadata.row_group(group).num_rows
            for start in range(0, total, PARQUET_ROWS):
                n = min(PARQUET_ROWS, total - start)

                def load(group: int = group, start: int = start, n: int = n) -> pa.RecordBatch:
                    if group not in read:
                        read.clear()
                        read[group] = f.read_row_group(group, columns=self._read).combine_chunks()
                    return read[group].slice(start, n).to_batches()[0]

                yield first, n, load
                first += n

    def _csv_reader(self, path: str) -> Iterator[pa.RecordBatch]:
        from pyarrow import csv

        bad: list[Any] = []

        def invalid(row: Any) -> str:
            if self.config.skip_bad_rows:
                self.bad_rows += 1
                return "skip"
            bad.append(row)
            return "error"

        names = [c.reads for c in self.schema.columns if c.column is None]
        try:
            reader = csv.open_csv(
                path,
                read_options=csv.ReadOptions(
                    block_size=CHUNK_BYTES, column_names=None if self.schema.header else names
                ),
                parse_options=csv.ParseOptions(
                    delimiter="\t" if self.kind == "tsv" else ",", invalid_row_handler=invalid
                ),
                convert_options=csv.ConvertOptions(
                    column_types=dict.fromkeys(self._read, pa.string()), include_columns=self._read
                ),
            )
            while True:
                try:
                    batch = reader.read_next_batch()
                except StopIteration:
                    return
                yield batch
        except pa.ArrowInvalid as e:
            if bad:
                row = bad[0]
                why = f"has {row.actual_columns} fields, expected {row.expected_columns}"
                raise DataFormatError(path, row.number or 0, "fields", row.text, why) from None
            if "Empty CSV file" in str(e):
                return
            raise DataFormatError(
                path, 0, "file", "", f"is not {self.kind.upper()} as the schema says: {e}"
            ) from None

    def _line(self, first_row: int) -> int:
        """The line (CSV) or row (Parquet) number of the file's row ``first_row`` (from 0)."""
        return first_row + (2 if self.kind != "parquet" and self.schema.header else 1)

    # -- converting
    def _samples(self, path: str, first_row: int, batch: pa.RecordBatch) -> Samples:
        """The block's samples; a bad value raises naming its place, or with skip_bad_rows its row is
        counted and dropped."""
        n = batch.num_rows
        bad = np.zeros(n, dtype=bool)
        problems: list[tuple[np.ndarray, Column, str]] = []

        def check(mask: np.ndarray, column: Column, why: str) -> None:
            if mask.any():
                problems.append((mask, column, why))
                bad[mask] = True

        label_column = self.schema.label
        labels, unparsed = _numbers(batch.column(label_column.reads), _FLOAT)
        check(unparsed | ~np.isin(labels, (0.0, 1.0)), label_column, "is not 0 or 1")
        dense = np.zeros((n, self.schema.num_dense), dtype=np.float32)
        for j, column in enumerate(self.schema.dense):
            values, unparsed = _numbers(batch.column(column.reads), _FLOAT, missing=0.0)
            check(unparsed, column, "is not a number")
            if column.transform == "log1p":
                values = np.log1p(np.maximum(values, 0.0))
            elif column.transform == "hour":
                values = np.log1p(np.mod(values, 100.0))
            dense[:, j] = values
            check(~np.isfinite(dense[:, j]) & ~unparsed, column, "is not finite")
        sparse = np.zeros((n, self.schema.num_tables), dtype=np.int64)
        for t, column in enumerate(self.schema.categorical):
            sparse[:, t] = self._rows_of(batch.column(column.reads), column, int(self.rows[t]), check)
        if bad.any():
            if not self.config.skip_bad_rows:
                first = int(np.argmax(bad))
                mask, column, why = next(p for p in problems if p[0][first])
                value = batch.column(column.reads)[first].as_py()
                raise DataFormatError(path, self._line(first_row + first), column.reads, _text(value), why)
            self.bad_rows += int(bad.sum())
            keep = ~bad
            return Samples(dense=dense[keep], sparse=sparse[keep], labels=labels[keep].astype(np.float32))
        return Samples(dense=dense, sparse=sparse, labels=labels.astype(np.float32))

    @staticmethod
    def _rows_of(
        array: pa.Array, column: Column, rows: int, check: Callable[[np.ndarray, Column, str], None]
    ) -> np.ndarray:
        """Each value's row in its table (missing: row 0)."""
        if column.hashing in ("mod", "none"):
            values, unparsed = _numbers(array, _INT, missing=0, kind=pa.int64())
            check(unparsed, column, "is not an integer")
            if column.hashing == "none":
                check((values < 0) | (values >= rows), column, f"is not a row of its table's [0, {rows})")
                return np.where((values >= 0) & (values < rows), values, 0)
            return np.mod(values, rows)
        text = array if pa.types.is_string(array.type) else pc.cast(array, pa.string())
        if pa.types.is_large_string(text.type):
            text = pc.cast(text, pa.string())
        _, offsets, data = text.buffers()
        n = len(text)
        bounds = np.frombuffer(offsets, dtype=np.int32, count=n + 1, offset=4 * text.offset).astype(np.int64)
        buf = np.frombuffer(data, dtype=np.uint8) if data is not None else np.zeros(1, dtype=np.uint8)
        starts, ends = bounds[:-1, None], bounds[1:, None]
        table = np.array([rows], dtype=np.int64)
        if column.hashing == "hash":
            out = _fnv_rows(buf, starts, ends, table)[:, 0]
        else:  # hex
            out, valid = _hex_rows(buf, starts, ends, table)
            out, valid = out[:, 0], valid[:, 0]
            check(~valid, column, "is not hexadecimal")
        missing = (ends[:, 0] == starts[:, 0]) | text.is_null().to_numpy(zero_copy_only=False)  # (or empty)
        return np.where(missing, 0, out)


def _numbers(
    array: pa.Array, pattern: str, missing: float | None = None, kind: pa.DataType = _FLOAT64
) -> tuple[np.ndarray, np.ndarray]:
    """``array`` as numbers of ``kind`` and the mask of values that are not (text not matching
    ``pattern``; a missing value is ``missing``, or not a number where that is None)."""
    if pa.types.is_string(array.type) or pa.types.is_large_string(array.type):
        text = pc.utf8_trim_whitespace(array)
        text = pc.if_else(pc.equal(text, ""), pa.scalar(None, text.type), text)
        ok = pc.match_substring_regex(text, pattern)
        ok_np = ok.fill_null(True).to_numpy(zero_copy_only=False)
        array = pc.cast(pc.if_else(ok, text, pa.scalar(None, text.type)), kind)
    else:
        ok_np = np.ones(len(array), dtype=bool)
        if pa.types.is_floating(array.type) and kind == pa.int64():
            whole = pc.equal(pc.floor(array), array).fill_null(True).to_numpy(zero_copy_only=False)
            ok_np &= whole
            array = pc.if_else(pa.array(whole), array, pa.scalar(None, array.type))
        array = pc.cast(array, kind)
    nulls = array.is_null().to_numpy(zero_copy_only=False)
    if missing is None:
        ok_np &= ~nulls
    values = array.fill_null(missing if missing is not None else 0).to_numpy(zero_copy_only=False)
    return values, ~ok_np


def _same(batch: pa.RecordBatch) -> pa.RecordBatch:
    return batch


def _text(value: Any) -> str:
    return "" if value is None else str(value)
