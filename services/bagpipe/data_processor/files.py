"""Click-log files as numbered global batches: Criteo TSV and Avazu CSV, parsed a chunk at a time.

(Over 400 lines: the two formats share the chunk reader, the numbering and the diagnostics; each
format's own parser is a few functions.)

**Numbering.** The valid samples of the files, concatenated in the order given, form one stream;
global batch ``b`` is samples ``[b*B, (b+1)*B)`` of it, and a final partial batch is dropped. With a
shuffle seed, the stream is first cut into windows of ``shuffle_buffer`` samples and each window is
permuted by ``numpy.random.default_rng([seed, window])``, so batch ``b`` depends only on the files,
the seed and the buffer, never on how many processors, trainers or servers read it.

**Splitting.** :meth:`FileSource.numbered` yields only batches ``start, start+stride, ...``: data
processor ``i`` of ``N`` asks for its own. It parses only the lines of those batches (or, shuffled,
of the windows they draw from) and passes over the others by counting newlines. That needs every line
to be a sample; with ``skip_bad_rows`` a malformed line shifts the numbering, so every line is checked
(the cheap part) and only the processor's own samples are built.

**Parsing** is vectorised over a chunk of lines: the field boundaries come from one scan for
separators, each field kind is decoded column-wise from a fixed-width byte matrix (decimal and
hexadecimal digits; FNV-1a hashes in one compiled pass over every byte), and a line that fails a check
is then described by the per-line diagnosis (file, line, field, value), or counted and dropped. The
values made are checked again column-wise (dense finite, labels 0 or 1, rows inside their tables), and
a sample that fails is traced back to its line and column in the same way. A line over
``MAX_LINE_BYTES`` is malformed too: memory stays within a chunk and that limit, whatever a field holds.

* **Criteo TSV**: ``label \\t I1..I13 \\t C1..C26``. An integer that is empty or negative counts as 0 and
  enters as log(1+x); a categorical value is hexadecimal, row ``int(value, 16) % rows``, empty row 0.
* **Avazu CSV**: ``id,click,hour,C1,banner_pos,site_id,...,C21`` (24 columns; a header line like that
  at the top of a file is checked and skipped). The label is ``click``. The 22 columns after ``click``
  (``hour`` included) are categorical: row = FNV-1a-64(raw bytes) % rows. The one dense feature is the
  hour of day (``hour`` is YYMMDDHH), as log(1+x).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from bagpipe.core.data import DataFormatError, Samples

logger = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 22  # bytes read and parsed at a time
MAX_LINE_BYTES = 1 << 20  # a longer line is malformed (memory stays within a chunk and this, not a line)
DEFAULT_SHUFFLE_BUFFER = 1 << 20  # samples permuted together with a shuffle seed

AVAZU_HEADER = (
    b"id,click,hour,C1,banner_pos,site_id,site_domain,site_category,app_id,app_domain,app_category,"
    b"device_id,device_ip,device_model,device_type,device_conn_type,C14,C15,C16,C17,C18,C19,C20,C21"
)
AVAZU_FIELDS = AVAZU_HEADER.decode().split(",")
AVAZU_NUM_TABLES = 22
AVAZU_NUM_DENSE = 1
# distinct values per categorical column in Avazu's train file (40.4 M samples, 9.4 M in all): the
# default table sizes; a field's hash modulo its size collides as a real hashed table would
AVAZU_TABLE_ROWS: tuple[int, ...] = (
    240,
    7,
    7,
    4737,
    7745,
    26,
    8552,
    559,
    36,
    2686408,
    6729486,
    8251,
    5,
    4,
    2626,
    8,
    9,
    435,
    4,
    68,
    172,
    60,
)
CRITEO_NUM_DENSE, CRITEO_NUM_TABLES = 13, 26

_INT_DIGITS = 18  # a dense value must fit int64 (Criteo's are far smaller)
_HEX_DIGITS = 32  # a categorical value is at most 128 bits (Criteo's are 32)
_NIBBLE = np.full(256, -1, dtype=np.int64)
for _i, _c in enumerate(b"0123456789abcdef"):
    _NIBBLE[_c] = _i
for _i, _c in enumerate(b"ABCDEF", start=10):
    _NIBBLE[_c] = _i


@dataclass(frozen=True)
class FileConfig:
    """``paths`` read in order as one stream; ``table_rows`` the sizes values are hashed into;
    ``skip_bad_rows`` counts and drops malformed lines instead of raising :class:`DataFormatError`;
    ``shuffle_seed`` (None: file order) and ``shuffle_buffer`` define the permutation."""

    paths: tuple[str, ...]
    table_rows: tuple[int, ...]
    skip_bad_rows: bool = False
    shuffle_seed: int | None = None
    shuffle_buffer: int = DEFAULT_SHUFFLE_BUFFER

    num_tables: ClassVar[int | None] = None  # (the format's tables, where it has a fixed number)

    def __post_init__(self) -> None:
        object.__setattr__(self, "paths", tuple(str(p) for p in self.paths))
        object.__setattr__(self, "table_rows", tuple(int(rows) for rows in self.table_rows))
        if not self.paths:
            raise ValueError("paths: must name at least one file")
        if self.num_tables is not None and len(self.table_rows) != self.num_tables:
            raise ValueError(f"table_rows: must have {self.num_tables} values, got {len(self.table_rows)}")
        if min(self.table_rows) < 1:
            raise ValueError(f"table_rows: every table needs >= 1 row, got {list(self.table_rows)}")
        if self.shuffle_buffer < 1:
            raise ValueError(f"shuffle_buffer: must be >= 1 sample, got {self.shuffle_buffer}")
        if self.shuffle_seed is not None and self.shuffle_seed < 0:
            raise ValueError(f"shuffle_seed: must be >= 0, got {self.shuffle_seed}")


class CriteoConfig(FileConfig):
    """Criteo TSV files (26 tables)."""

    num_tables = CRITEO_NUM_TABLES


class AvazuConfig(FileConfig):
    """Avazu CSV files (22 tables)."""

    num_tables = AVAZU_NUM_TABLES


# ---------------------------------------------------------------------------------------------------
# vectorised field decoding


def _split(buf: np.ndarray, sep: int, fields: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Field starts and ends ``[lines_ok, fields]`` of ``buf`` (lines ending in b"\\n") and the mask of
    lines with the right number of fields."""
    newline = buf == 10
    ends = np.flatnonzero(newline | (buf == sep))
    starts = np.empty_like(ends)
    starts[0] = 0
    starts[1:] = ends[:-1] + 1
    at_newline = newline[ends]
    line_of = np.cumsum(at_newline) - at_newline
    lines = int(at_newline.sum())
    ok = np.bincount(line_of, minlength=lines) == fields
    if not ok.all():
        keep = ok[line_of]
        starts, ends = starts[keep], ends[keep]
    return starts.reshape(-1, fields), ends.reshape(-1, fields), ok


def _columns(
    buf: np.ndarray, starts: np.ndarray, ends: np.ndarray, width: int
) -> tuple[np.ndarray, np.ndarray]:
    """The fields' last ``width`` bytes, right-aligned, as ``[width, ...]`` (position-major, so each step of
    a digit loop reads a contiguous array; 0 before a field's first byte), and the mask of real bytes.
    Each field's bytes come in one row of a sliding window over the chunk (a short copy, not a gather)."""
    padded = np.concatenate([np.zeros(width, dtype=np.uint8), buf])
    rows = np.lib.stride_tricks.sliding_window_view(padded, width)[
        ends
    ]  # [..., width]: bytes ends-width..ends-1
    inside = np.arange(width) >= (width - (ends - starts))[..., None]
    mat = np.where(inside, rows, 0)
    return np.ascontiguousarray(np.moveaxis(mat, -1, 0)), np.moveaxis(inside, -1, 0)


def _widest(starts: np.ndarray, ends: np.ndarray, cap: int) -> int:
    return max(1, min(int((ends - starts).max(initial=0)), cap))


def _decimal(buf: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Criteo integers: (value with empty and negative as 0, valid) — valid: empty, or an optional '-'
    and 1 to 18 digits."""
    lengths = ends - starts
    width = _widest(starts, ends, _INT_DIGITS + 1)
    mat, inside = _columns(buf, starts, ends, width)
    digit = (mat >= 48) & (mat <= 57)
    minus = (buf[np.minimum(starts, buf.size - 1)] == 45) & (lengths > 0)
    bad_chars = (inside & ~digit).sum(0) - minus  # a '-' may be the first byte only
    digits = lengths - minus
    valid = (bad_chars == 0) & ((lengths == 0) | ((digits >= 1) & (digits <= _INT_DIGITS)))
    value = np.zeros(lengths.shape, dtype=np.int64)
    for k in range(width):
        value = value * 10 + np.where(digit[k], mat[k], 48).astype(np.int64) - 48
    return np.where(minus | ~valid, 0, value), valid


def _hex_rows(
    buf: np.ndarray, starts: np.ndarray, ends: np.ndarray, rows: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Criteo categoricals: (int(value, 16) % rows, empty 0; valid: at most 32 hex digits). Up to 15 digits
    the value is exact in int64 (Horner over right-aligned digits); longer ones, which real logs do not
    have, are converted one by one."""
    lengths = ends - starts
    width = _widest(starts, ends, 15)
    mat, inside = _columns(buf, starts, ends, width)
    nibble = _NIBBLE[mat]
    valid = ((nibble >= 0) | ~inside).all(0) & (lengths <= _HEX_DIGITS)
    value = np.zeros(lengths.shape, dtype=np.int64)
    for k in range(width):
        value = value * 16 + np.maximum(nibble[k], 0)
    value %= rows
    for i in zip(*np.nonzero(lengths > width), strict=True):  # (only fields longer than 15 digits)
        text = bytes(buf[starts[i] : ends[i]])
        ok = len(text) <= _HEX_DIGITS and all(c in b"0123456789abcdefABCDEF" for c in text)
        valid[i] = ok
        value[i] = int(text, 16) % int(rows[i[-1]]) if ok else 0
    return value, valid


@functools.cache
def _fnv_kernel() -> Callable[..., np.ndarray]:
    """The compiled FNV-1a loop, built on first use: ``bagpipe run`` reads this module's configs at start
    without loading numba, which only a process that hashes needs."""
    from numba import njit

    @njit(cache=True, nogil=True)
    def fnv_rows(buf, starts, ends, rows):  # type: ignore[no-untyped-def]
        out = np.empty(starts.shape, dtype=np.int64)
        for i in range(starts.shape[0]):
            for t in range(starts.shape[1]):
                h = np.uint64(0xCBF29CE484222325)
                for k in range(starts[i, t], ends[i, t]):
                    h = (h ^ np.uint64(buf[k])) * np.uint64(0x100000001B3)
                out[i, t] = np.int64(h % np.uint64(rows[t]))
        return out

    return fnv_rows  # type: ignore[no-any-return]


def _fnv_rows(buf: np.ndarray, starts: np.ndarray, ends: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Avazu categoricals: FNV-1a-64 of every byte of each field, modulo its table's rows. One compiled pass
    over the fields' bytes: a column-wise loop would pad every field to the longest one's width, and a
    1,000-byte field in a 4 MiB chunk would then need gigabytes."""
    return _fnv_kernel()(  # type: ignore[no-any-return]
        buf,
        np.ascontiguousarray(starts, dtype=np.int64),
        np.ascontiguousarray(ends, dtype=np.int64),
        np.ascontiguousarray(rows, dtype=np.int64),
    )


def fnv1a64(value: bytes) -> int:
    """FNV-1a-64 of ``value`` (the Avazu categorical hash, one value at a time)."""
    h = 0xCBF29CE484222325
    for byte in value:
        h = ((h ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


# ---------------------------------------------------------------------------------------------------
# per-format parsing and diagnosis


_CRITEO_FIELDS = 1 + CRITEO_NUM_DENSE + CRITEO_NUM_TABLES


def _criteo_parse(buf: np.ndarray, rows: np.ndarray) -> tuple[Samples, np.ndarray]:
    """Samples of the valid lines of a chunk, and the per-line validity mask."""
    starts, ends, ok = _split(buf, 9, _CRITEO_FIELDS)
    label_ok = (ends[:, 0] - starts[:, 0] == 1) & np.isin(buf[starts[:, 0]], (48, 49))
    ints, ints_ok = _decimal(buf, starts[:, 1:14], ends[:, 1:14])
    cats, cats_ok = _hex_rows(buf, starts[:, 14:], ends[:, 14:], rows)
    good = label_ok & ints_ok.all(1) & cats_ok.all(1)
    valid = ok.copy()
    valid[ok] = good
    samples = Samples(
        dense=np.log1p(ints[good].astype(np.float64)).astype(np.float32),
        sparse=cats[good],
        labels=(buf[starts[good, 0]] == 49).astype(np.float32),
    )
    return samples, valid


def _criteo_diagnose(path: str, number: int, line: bytes) -> DataFormatError:
    """The first problem of a malformed Criteo line."""

    def error(field: str, value: bytes, reason: str) -> DataFormatError:
        return DataFormatError(path, number, field, value.decode("utf-8", "replace"), reason)

    fields = line.split(b"\t")
    if len(fields) != _CRITEO_FIELDS:
        return error("fields", line, f"has {len(fields)} tab-separated fields, expected {_CRITEO_FIELDS}")
    if fields[0] not in (b"0", b"1"):
        return error("label", fields[0], "is not 0 or 1")
    for k in range(1, CRITEO_NUM_DENSE + 1):
        if not re.fullmatch(rb"(?:-?[0-9]{1,%d})?" % _INT_DIGITS, fields[k]):
            if re.fullmatch(rb"-?[0-9]+", fields[k]):
                return error(f"I{k}", fields[k], f"is out of range (more than {_INT_DIGITS} digits)")
            if re.fullmatch(rb"[+-]?(?:nan|inf|infinity)", fields[k], re.IGNORECASE):
                return error(f"I{k}", fields[k], "is not finite (an integer is expected)")
            return error(f"I{k}", fields[k], "is not an integer")
    for k in range(1, CRITEO_NUM_TABLES + 1):
        value = fields[CRITEO_NUM_DENSE + k]
        if not re.fullmatch(rb"[0-9A-Fa-f]{0,%d}" % _HEX_DIGITS, value):
            if re.fullmatch(rb"[0-9A-Fa-f]+", value):
                return error(f"C{k}", value, f"is too long (more than {_HEX_DIGITS} hex digits)")
            return error(f"C{k}", value, "is not hexadecimal")
    return error("line", line, "is malformed")


def _avazu_parse(buf: np.ndarray, rows: np.ndarray) -> tuple[Samples, np.ndarray]:
    starts, ends, ok = _split(buf, 44, len(AVAZU_FIELDS))
    click_ok = (ends[:, 1] - starts[:, 1] == 1) & np.isin(buf[starts[:, 1]], (48, 49))
    hour, hour_ok = _decimal(buf, starts[:, 2], ends[:, 2])
    hour_ok &= (ends[:, 2] - starts[:, 2] == 8) & (hour % 100 <= 23) & (buf[starts[:, 2]] != 45)
    good = click_ok & hour_ok
    valid = ok.copy()
    valid[ok] = good
    return (
        Samples(
            dense=np.log1p((hour[good] % 100).astype(np.float64)).astype(np.float32).reshape(-1, 1),
            sparse=_fnv_rows(buf, starts[good, 2:], ends[good, 2:], rows),
            labels=(buf[starts[good, 1]] == 49).astype(np.float32),
        ),
        valid,
    )


def _avazu_diagnose(path: str, number: int, line: bytes) -> DataFormatError:
    def error(field: str, value: bytes, reason: str) -> DataFormatError:
        return DataFormatError(path, number, field, value.decode("utf-8", "replace"), reason)

    fields = line.split(b",")
    if len(fields) != len(AVAZU_FIELDS):
        return error(
            "fields", line, f"has {len(fields)} comma-separated fields, expected {len(AVAZU_FIELDS)}"
        )
    if fields[1] not in (b"0", b"1"):
        return error("click", fields[1], "is not 0 or 1")
    if not re.fullmatch(rb"[0-9]{6}([01][0-9]|2[0-3])", fields[2]):
        return error("hour", fields[2], "is not an hour YYMMDDHH")
    return error("line", line, "is malformed")


# ---------------------------------------------------------------------------------------------------
# the stream


@dataclass
class _Block:
    """Parsed samples with their positions ``[first, first + len)`` in the (shuffled) sample stream."""

    first: int
    samples: Samples


class FileSource:
    """Numbered batches of click-log files (see the module's docstring). ``bad_rows`` and
    ``samples_read`` describe the latest pass: malformed lines dropped, and valid samples counted."""

    header: bytes | None = None
    num_dense = CRITEO_NUM_DENSE
    # a line's columns: their names, the separator, and where the label, dense and categorical values are
    separator = 9
    field_names: tuple[str, ...] = (
        "label",
        *(f"I{k}" for k in range(1, CRITEO_NUM_DENSE + 1)),
        *(f"C{k}" for k in range(1, CRITEO_NUM_TABLES + 1)),
    )
    label_column = 0
    dense_columns: tuple[int, ...] = tuple(range(1, 1 + CRITEO_NUM_DENSE))
    sparse_columns: tuple[int, ...] = tuple(range(1 + CRITEO_NUM_DENSE, _CRITEO_FIELDS))

    def __init__(self, config: FileConfig) -> None:
        self.config = config
        self.rows = np.asarray(config.table_rows, dtype=np.int64)
        self.bad_rows = 0
        self.samples_read = 0

    def _parse(self, buf: np.ndarray) -> tuple[Samples, np.ndarray]:
        raise NotImplementedError

    def _diagnose(self, path: str, number: int, line: bytes) -> DataFormatError:
        raise NotImplementedError

    def check_head(self) -> None:
        """Parses the first chunk (``CHUNK_BYTES``) of every file as its batches would, and reads no more:
        raises the ``DataFormatError`` of a file whose first lines do not parse, or that is empty (with
        skip_bad_rows, bad lines are counted instead)."""
        for path in self.config.paths:
            one = type(self)(dataclasses.replace(self.config, paths=(path,)))
            first = next(one._chunks(), None)
            if first is not None:
                one._parsed(*first)

    # -- reading
    def _chunks(self) -> Iterator[tuple[str, int, bytes]]:
        """(path, number of the chunk's first line, chunk of whole lines ending in b"\\n", \\r removed)."""
        for path in self.config.paths:
            seen, skipped = False, self.bad_rows
            for line_number, data in self._file_chunks(path):
                if not seen and self.header is not None and data.startswith(self.header[:9]):
                    first_end = data.index(b"\n")
                    if data[:first_end] != self.header:
                        found = data[:first_end].decode("utf-8", "replace")
                        why = f"is not Avazu's header {self.header.decode()!r}"
                        raise DataFormatError(path, 1, "header", found, why)
                    data, line_number = data[first_end + 1 :], line_number + 1
                seen = seen or bool(data)
                if data:
                    yield path, line_number, data
            if not seen and self.bad_rows == skipped:  # (lines too long, skipped, are lines)
                raise DataFormatError(path, 0, "file", "", "is empty: no samples")

    def _file_chunks(self, path: str) -> Iterator[tuple[int, bytes]]:
        """(number of the first line, whole lines ending in b"\\n", \\r\\n as \\n) of one file, read
        ``CHUNK_BYTES`` at a time. A line over ``MAX_LINE_BYTES`` raises, or with skip_bad_rows is counted
        and left out: a line whose end is not in sight once it is over the limit is passed over a block at a
        time, so memory stays within a chunk and the limit, whatever the longest line."""
        line_number, carry, dropping = 1, b"", False
        with open(path, "rb") as f:
            while True:
                block = f.read(CHUNK_BYTES)
                end = not block
                if dropping:  # the rest of an over-long line
                    cut = block.find(b"\n")
                    if cut < 0 and not end:
                        continue
                    dropping, block, line_number = False, block[cut + 1 :], line_number + 1
                data = carry + block
                if not end:
                    cut = data.rfind(b"\n") + 1
                    data, carry = data[:cut], data[cut:]
                elif data:
                    data, carry = data + b"\n", b""
                if data:
                    if b"\r" in data:
                        data = data.replace(b"\r\n", b"\n")
                    yield from self._within_limit(path, line_number, data)
                    line_number += data.count(b"\n")
                if len(carry) > MAX_LINE_BYTES:
                    self._too_long(path, line_number, carry)
                    dropping, carry = True, b""
                if end:
                    break

    def _within_limit(self, path: str, first_line: int, data: bytes) -> Iterator[tuple[int, bytes]]:
        """``data`` (whole lines) cut around its lines over ``MAX_LINE_BYTES``: the lines before the first
        such line, then its error (or with skip_bad_rows, it is counted and the lines after it follow)."""
        at = 0
        for start, end, index in _long_lines(data):
            if start > at:
                yield first_line + data.count(b"\n", 0, at), data[at:start]
            self._too_long(path, first_line + index, data[start:end])
            at = end + 1
        if at < len(data):
            yield first_line + data.count(b"\n", 0, at), data[at:] if at else data

    def _too_long(self, path: str, number: int, line: bytes) -> None:
        if not self.config.skip_bad_rows:
            value = line[:80].decode("utf-8", "replace")
            why = f"starts a line longer than {MAX_LINE_BYTES} bytes (the most a line may hold)"
            raise DataFormatError(path, number, "line", value, why)
        self.bad_rows += 1
        logger.debug("%s: skipping line %d, longer than %d bytes", path, number, MAX_LINE_BYTES)

    def _parsed(self, path: str, first_line: int, data: bytes) -> Samples:
        """Samples of the chunk's valid lines; a malformed line raises (or is counted with skip_bad_rows).
        The values the parse made are checked again, column-wise: dense features finite, labels 0 or 1,
        rows inside their tables."""
        samples, valid = self._parse(np.frombuffer(data, dtype=np.uint8))
        out_of_domain = _out_of_domain(samples, self.rows)
        refused = np.zeros(valid.shape, dtype=bool)
        if out_of_domain.any():
            refused[np.flatnonzero(valid)[out_of_domain]] = True
        if not valid.all() or refused.any():
            bad = np.flatnonzero(~valid | refused)
            if not self.config.skip_bad_rows:
                index = int(bad[0])
                line = data.split(b"\n", index + 1)[index]
                if refused[index]:
                    sample = int(np.count_nonzero(valid[:index]))
                    raise self._value_error(path, first_line + index, line, samples, sample)
                raise self._diagnose(path, first_line + index, line)
            if refused.any():
                samples = _rows(samples, ~out_of_domain)
            self.bad_rows += int(bad.size)
            logger.debug("%s: skipping %d bad rows from line %d", path, bad.size, first_line + int(bad[0]))
        return samples

    def _lines(
        self, path: str, first_line: int, data: bytes, newlines: np.ndarray, i: int, j: int
    ) -> Samples:
        """Samples of the chunk's lines [i, j) (``newlines``: where its lines end): the wanted run of a chunk
        whose other lines are counted, never parsed."""
        lo = 0 if i == 0 else int(newlines[i - 1]) + 1
        hi = int(newlines[j - 1]) + 1
        return self._parsed(path, first_line + i, data[lo:hi])

    def _value_error(self, path: str, number: int, line: bytes, samples: Samples, i: int) -> DataFormatError:
        """The first value of sample ``i`` (line ``number``) out of its domain, named by its column."""
        fields = line.split(bytes([self.separator]))

        def error(column: int, reason: str) -> DataFormatError:
            text = fields[column].decode("utf-8", "replace") if column < len(fields) else ""
            return DataFormatError(path, number, self.field_names[column], text, reason)

        dense = samples.dense[i]
        if not np.isfinite(dense).all():
            j = int(np.argmin(np.isfinite(dense)))
            return error(self.dense_columns[j], f"gives dense value {float(dense[j])}, which is not finite")
        label = float(samples.labels[i])
        if label not in (0.0, 1.0):
            return error(self.label_column, f"gives label {label}, which is not 0 or 1")
        sparse = samples.sparse[i]
        t = int(np.argmax((sparse < 0) | (sparse >= self.rows)))
        why = f"gives row {int(sparse[t])}, outside its table's [0, {int(self.rows[t])})"
        return error(self.sparse_columns[t], why)

    def _stream(
        self, wanted: Callable[[int, int], list[tuple[int, int]]]
    ) -> Iterator[tuple[int, int, Samples | None]]:
        """``(first, count, samples)`` runs of the sample stream in file order, ``samples`` None where
        ``wanted(first, count)`` (absolute sample ranges) leaves them out. Without skip_bad_rows a line is a
        sample, so unwanted lines are only counted, never parsed."""
        self.bad_rows = self.samples_read = 0
        position = 0
        for path, first_line, data in self._chunks():
            if self.config.skip_bad_rows:
                samples = self._parsed(path, first_line, data)
                n = len(samples)
                yield from runs_of(position, n, wanted(position, n), functools.partial(_slice, samples))
            else:
                n = data.count(b"\n")
                runs = wanted(position, n)
                if runs:  # (unwanted lines are counted, never parsed)
                    newlines = np.flatnonzero(np.frombuffer(data, dtype=np.uint8) == 10)
                    lines = functools.partial(self._lines, path, first_line, data, newlines)
                    yield from runs_of(position, n, runs, lines)
                elif n:
                    yield position, n, None
            position += n
            self.samples_read = position

    # -- batches
    def numbered(
        self, batch_size: int, start: int = 0, stride: int = 1
    ) -> Iterator[tuple[int, Samples, bool]]:
        """``(number, samples, last)`` for batches ``start, start+stride, ...``; ``last``: no full batch of
        any number follows it."""
        if batch_size < 1:
            raise ValueError(f"batch_size: must be >= 1, got {batch_size}")
        if start < 0 or stride < 1:
            raise ValueError(f"start/stride: must be >= 0 / >= 1, got {start}/{stride}")
        shuffled = self.config.shuffle_seed is not None
        unit = self.config.shuffle_buffer if shuffled else batch_size

        def mine(unit_index: int) -> bool:
            """Whether a unit (a batch, or a shuffle window) holds samples of one of our batches."""
            low = max(start, unit_index * unit // batch_size)
            high = ((unit_index + 1) * unit - 1) // batch_size
            first = low + (-(low - start)) % stride
            return first <= high

        def wanted(first: int, count: int) -> list[tuple[int, int]]:
            runs: list[tuple[int, int]] = []
            for u in range(first // unit, (first + count - 1) // unit + 1 if count else first // unit):
                if mine(u):
                    a, b = max(first, u * unit), min(first + count, (u + 1) * unit)
                    if runs and runs[-1][1] == a and not shuffled:  # (a shuffle window is a run of its own)
                        runs[-1] = (runs[-1][0], b)
                    else:
                        runs.append((a, b))
            return runs

        blocks: list[_Block] = []  # wanted samples at their stream positions (shuffled: whole windows)
        window: list[Samples] = []
        ready: list[int] = []  # own batches whose samples are all in blocks
        candidate = start
        end = 0
        for first, count, samples in self._stream(wanted):
            end = first + count
            if samples is not None:
                if not shuffled:
                    blocks.append(_Block(first, samples))
                else:
                    window.append(samples)
                    if end % unit == 0:  # a whole window: permute it
                        blocks.append(self._permuted(window, end // unit - 1))
                        window = []
            covered = blocks[-1].first + len(blocks[-1].samples) if blocks else 0
            while (candidate + 1) * batch_size <= covered:
                ready.append(candidate)
                candidate += stride
            while ready and end >= (ready[0] + 2) * batch_size:  # a full batch follows it: not the last
                number = ready.pop(0)
                yield number, self._take(blocks, number, batch_size), False
        if window:  # the last, partial window
            blocks.append(self._permuted(window, (end - 1) // unit))
            covered = blocks[-1].first + len(blocks[-1].samples)
            while (candidate + 1) * batch_size <= covered:
                ready.append(candidate)
                candidate += stride
        for number in ready:
            yield number, self._take(blocks, number, batch_size), (number + 2) * batch_size > end
        if self.bad_rows:
            logger.info("skipped %d bad rows out of %d", self.bad_rows, self.bad_rows + self.samples_read)

    def batches(self, batch_size: int, start: int = 0, stride: int = 1) -> Iterator[tuple[int, Samples]]:
        """``(number, samples)`` for batches ``start, start+stride, ...`` (see :meth:`numbered`)."""
        for number, samples, _ in self.numbered(batch_size, start, stride):
            yield number, samples

    def _permuted(self, parts: list[Samples], index: int) -> _Block:
        whole = _concat(parts)
        order = np.random.default_rng([int(self.config.shuffle_seed or 0), index]).permutation(len(whole))
        permuted = Samples(dense=whole.dense[order], sparse=whole.sparse[order], labels=whole.labels[order])
        return _Block(index * self.config.shuffle_buffer, permuted)

    @staticmethod
    def _take(blocks: list[_Block], number: int, batch_size: int) -> Samples:
        """Batch ``number`` from ``blocks``, dropping the blocks that end before its end."""
        lo, hi = number * batch_size, (number + 1) * batch_size
        parts = []
        for block in blocks:
            a, b = max(lo, block.first), min(hi, block.first + len(block.samples))
            if a < b:
                s, i, j = block.samples, a - block.first, b - block.first
                parts.append(_slice(s, i, j))
        blocks[:] = [b for b in blocks if b.first + len(b.samples) > hi]
        out = _concat(parts)
        assert len(out) == batch_size, f"batch {number}: {len(out)} of {batch_size} samples"
        return out


def runs_of(
    position: int, count: int, runs: list[tuple[int, int]], take: Callable[[int, int], Samples]
) -> Iterator[tuple[int, int, Samples | None]]:
    """``(first, count, samples)`` over the ``count`` samples of a block that starts at ``position`` in the
    stream: each wanted run ``[a, b)`` (absolute) with ``take(a - position, b - position)``, the gaps
    between them as None."""
    cursor = position
    for a, b in runs:
        if a > cursor:
            yield cursor, a - cursor, None
        yield a, b - a, take(a - position, b - position)
        cursor = b
    if position + count > cursor:
        yield cursor, position + count - cursor, None


def _slice(samples: Samples, i: int, j: int) -> Samples:
    return Samples(dense=samples.dense[i:j], sparse=samples.sparse[i:j], labels=samples.labels[i:j])


def _concat(parts: list[Samples]) -> Samples:
    if len(parts) == 1:
        return parts[0]
    return Samples(
        dense=np.concatenate([p.dense for p in parts]),
        sparse=np.concatenate([p.sparse for p in parts]),
        labels=np.concatenate([p.labels for p in parts]),
    )


def _rows(samples: Samples, keep: np.ndarray) -> Samples:
    return Samples(dense=samples.dense[keep], sparse=samples.sparse[keep], labels=samples.labels[keep])


def _out_of_domain(samples: Samples, rows: np.ndarray) -> np.ndarray:
    """Per sample: a dense feature that is not finite, a label other than 0 and 1, or a row outside its
    table (``rows``: the tables' sizes)."""
    return (
        ~np.isfinite(samples.dense).all(1)
        | ((samples.labels != 0) & (samples.labels != 1))
        | ((samples.sparse < 0) | (samples.sparse >= rows)).any(1)
    )


def _long_lines(data: bytes) -> list[tuple[int, int, int]]:
    """(start, end, index) of each line of ``data`` (whole lines) longer than ``MAX_LINE_BYTES``. Such a
    line holds a newline-free aligned block of half the limit; 8 searches for one rule out a 4 MiB chunk,
    and only a chunk with one is scanned line by line."""
    half = max(1, MAX_LINE_BYTES // 2)
    if all(data.find(b"\n", s, s + half) >= 0 for s in range(0, len(data) - half + 1, half)):
        return []
    ends = np.flatnonzero(np.frombuffer(data, dtype=np.uint8) == 10)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [(int(starts[i]), int(ends[i]), int(i)) for i in np.flatnonzero(ends - starts > MAX_LINE_BYTES)]


class CriteoTSVSource(FileSource):
    """Criteo TSV files (``label \\t I1..I13 \\t C1..C26``) as numbered batches."""

    def _parse(self, buf: np.ndarray) -> tuple[Samples, np.ndarray]:
        return _criteo_parse(buf, self.rows)

    def _diagnose(self, path: str, number: int, line: bytes) -> DataFormatError:
        return _criteo_diagnose(path, number, line)


class AvazuCSVSource(FileSource):
    """Avazu CSV files (``id,click,hour,C1,...,C21``) as numbered batches."""

    header = AVAZU_HEADER
    num_dense = AVAZU_NUM_DENSE
    separator = 44
    field_names = tuple(AVAZU_FIELDS)
    label_column = 1
    dense_columns = (2,)  # (the hour of day, from ``hour``)
    sparse_columns = tuple(range(2, len(AVAZU_FIELDS)))

    def _parse(self, buf: np.ndarray) -> tuple[Samples, np.ndarray]:
        return _avazu_parse(buf, self.rows)

    def _diagnose(self, path: str, number: int, line: bytes) -> DataFormatError:
        return _avazu_diagnose(path, number, line)
