"""Numpy arrays to and from ``bagpipe.v1.Tensor``: raw little-endian bytes with dtype and shape.

:func:`to_tensor` builds a ``Tensor`` message. On the hottest paths (an embedding server's lookup reply, a
trainer's write-back) :func:`encode_message` writes a whole message's bytes instead, as protobuf would
serialise it, so each array's bytes are copied once into the result rather than once per protobuf layer
(the array's bytes, the field, the parent message, the serialised string); gRPC then sends those bytes
as they are (:func:`serialized`). :func:`decode_message` reads such a message back with its tensors as
views of the received bytes; the generated classes parse the same bytes too. A field may also be
:class:`Gather` (rows of a table by index), which is gathered straight into the result, so a lookup's
rows are copied once in all: from the table into the message.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np

from bagpipe.core.intrinsics import gather_rows
from bagpipe.errors import InvalidArgument
from bagpipe.v1 import tensor_pb2

# each dtype the wire carries, and its ``Tensor.dtype`` code
DTYPE_CODES: dict[np.dtype, tensor_pb2.DType] = {
    np.dtype("<f4"): tensor_pb2.DTYPE_FLOAT32,
    np.dtype("<i8"): tensor_pb2.DTYPE_INT64,
    np.dtype("<i4"): tensor_pb2.DTYPE_INT32,
    np.dtype("bool"): tensor_pb2.DTYPE_BOOL,
    np.dtype("uint8"): tensor_pb2.DTYPE_UINT8,
}
_FROM_PROTO = {v: k for k, v in DTYPE_CODES.items()}
_NAMES = {v: k.name for k, v in DTYPE_CODES.items()}


def _wire_dtype(array: np.ndarray) -> np.dtype:
    """The little-endian dtype ``array`` travels as; TypeError for one the wire has no name for."""
    dtype = array.dtype.newbyteorder("<") if array.dtype.byteorder == ">" else array.dtype
    if dtype not in DTYPE_CODES:
        raise TypeError(f"unsupported dtype {array.dtype}")
    return dtype


def to_tensor(array: np.ndarray) -> tensor_pb2.Tensor:
    """Encodes ``array`` (float32, int64, int32, bool or uint8) without an intermediate Python list."""
    dtype = _wire_dtype(array)
    # tobytes() writes C order from any strides: one copy, even for a column slice of a packed table
    data = array.astype(dtype, copy=False).tobytes()
    return tensor_pb2.Tensor(dtype=DTYPE_CODES[dtype], shape=list(array.shape), data=data)


def from_tensor(
    tensor: tensor_pb2.Tensor,
    field: str | tuple[str, str],
    dtype: np.dtype | type | str,
    ndim: int | None = None,
    shape: tuple[int | None, ...] | None = None,
) -> np.ndarray:
    """Decodes and validates a Tensor; raises InvalidArgument naming ``field`` on any mismatch (a pair is
    joined as ``"where: name"``, only then: a trainer reads a hundred tensors a batch).

    ``shape`` entries of None match any size. The result is a read-only view of the message bytes.
    """
    want = _WANT.get(dtype) if isinstance(dtype, type) else None
    if want is None:
        want = np.dtype(dtype)
    got = _FROM_PROTO.get(tensor.dtype)
    if got != want:
        name = _field(field)
        if got is None:
            raise InvalidArgument(name, f"unknown dtype {tensor.dtype}")
        raise InvalidArgument(name, f"dtype must be {want.name}, got {_NAMES[tensor.dtype]}")
    dims = tuple(tensor.shape)
    if dims and min(dims) < 0:
        raise InvalidArgument(_field(field), f"negative dimension in shape {list(dims)}")
    if ndim is not None and len(dims) != ndim:
        raise InvalidArgument(_field(field), f"must have {ndim} dimensions, got shape {list(dims)}")
    if (
        shape is not None
        and dims != shape
        and (
            len(dims) != len(shape) or any(s is not None and s != d for s, d in zip(shape, dims, strict=True))
        )
    ):
        expect = ["*" if s is None else s for s in shape]
        raise InvalidArgument(_field(field), f"shape must be {expect}, got {list(dims)}")
    data = tensor.data  # (read once: each read of a message's bytes field makes a bytes object)
    if len(data) != math.prod(dims) * want.itemsize:
        raise InvalidArgument(
            _field(field), f"{len(data)} bytes do not hold shape {list(dims)} of {want.name}"
        )
    return np.frombuffer(data, dtype=want).reshape(dims)


def _field(field: str | tuple[str, str]) -> str:
    return field if isinstance(field, str) else f"{field[0]}: {field[1]}"


# (numpy's scalar types a caller names, as dtypes: np.dtype() of a type costs a dictionary's lookups)
_WANT: dict[Any, np.dtype] = {t: np.dtype(t) for t in (np.float32, np.int64, np.int32, np.uint8, np.bool_)}


def _varint_slow(value: int) -> bytes:
    value &= (1 << 64) - 1  # negative int64: ten bytes of two's complement, as protobuf writes it
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


_SMALL_VARINTS = [_varint_slow(v) for v in range(1 << 14)]  # tags, dtypes, dims, small sizes: one lookup
# a value's low 14 bits as the two bytes of a varint that goes on (an array's size in bytes, up to 256 MiB:
# two lookups rather than _varint_slow's loop, which took most of a large array's field)
_GOING_ON = [bytes(((v & 0x7F) | 0x80, (v >> 7) | 0x80)) for v in range(1 << 14)]


def _varint(value: int) -> bytes:
    if 0 <= value < 1 << 14:
        return _SMALL_VARINTS[value]
    if 0 < value < 1 << 28:
        return _GOING_ON[value & 0x3FFF] + _SMALL_VARINTS[value >> 14]
    return _varint_slow(value)


_DTYPE_FIELDS = {dtype: b"\x08" + _varint(number) for dtype, number in DTYPE_CODES.items()}


@dataclass(frozen=True)
class Gather:
    """``table[index]`` (rows of a 2-D C-contiguous table, ``index`` checked to be in range by the
    caller) as a message field: :func:`encode_message` gathers the rows straight into the message.
    ``np.asarray`` gathers them into an array of their own."""

    table: np.ndarray
    index: np.ndarray

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        rows = self.table.take(self.index, axis=0)
        return rows if dtype is None else rows.astype(dtype, copy=False)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.index.size, self.table.shape[1])

    @property
    def nbytes(self) -> int:
        return self.index.size * self.table.shape[1] * self.table.itemsize

    def into(self, out: np.ndarray) -> None:
        """Gathers the rows into ``out``, bytes (``uint8``) of the right size."""
        rows = out.view(self.table.dtype).reshape(self.shape)
        if self.table.dtype == np.float32 and self.index.dtype == np.int64:
            gather_rows(self.table, self.index, rows)
        else:  # (mode "wrap": with "raise", numpy gathers into a temporary first, then copies it)
            self.table.take(self.index, axis=0, out=rows, mode="wrap")


def _gatherable(table: np.ndarray) -> bool:
    return table.ndim == 2 and table.flags.c_contiguous


def gather(table: np.ndarray, index: np.ndarray) -> Gather | np.ndarray:
    """``table[index]`` as a message field: a :class:`Gather` where the table allows it (2-D and
    C-contiguous), else the gathered array."""
    return Gather(table, index) if _gatherable(table) else table[index]


def _tensor_parts(number: int, array: np.ndarray | Gather) -> tuple[list[Any], int]:
    """Field ``number`` holding ``array`` as a ``Tensor`` (dtype = 1, shape = 2 packed, data = 3), and its
    size in bytes."""
    data: np.ndarray | Gather
    if isinstance(array, Gather):
        if not _gatherable(array.table):
            raise ValueError(f"Gather: the table must be 2-D and C-contiguous, got shape {array.table.shape}")
        dtype, data = _wire_dtype(array.table), array
    else:
        dtype = _wire_dtype(array)
        # (an array as the wire has it already is sent as it is: a plan's dozen arrays a batch)
        ready = array.ndim and array.dtype is dtype and array.flags.c_contiguous  # (0-d: made [1], as before)
        data = array if ready else np.ascontiguousarray(array, dtype)
    head = _DTYPE_FIELDS[dtype]
    shape = data.shape
    if len(shape) == 1:
        dims = _varint(shape[0])
        head += b"\x12" + _SMALL_VARINTS[len(dims)] + dims
    elif shape:
        dims = b"".join([_varint(int(d)) for d in shape])
        head += b"\x12" + _varint(len(dims)) + dims
    nbytes = data.nbytes
    if not nbytes:
        tag = _varint(number << 3 | 2) + _varint(len(head))
        return [tag, head], len(tag) + len(head)
    head += b"\x1a" + _varint(nbytes)
    tag = _varint(number << 3 | 2) + _varint(len(head) + nbytes)
    return [tag, head, data], len(tag) + len(head) + nbytes


def tensor_head(number: int, array: np.ndarray) -> bytes:
    """The bytes of field ``number`` holding ``array`` as a ``Tensor``, up to its data: what
    :func:`encode_message` writes before the array's bytes (the same for every array of its dtype and
    shape)."""
    return b"".join(_tensor_parts(number, array)[0][:2])


def _size(part: Any) -> int:
    return part.nbytes if isinstance(part, np.ndarray | Gather) else len(part)


# CPython's own constructor for a bytes object whose contents the caller writes before anyone reads it
_new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
_new_bytes.argtypes = [ctypes.c_char_p, ctypes.c_ssize_t]
_new_bytes.restype = ctypes.py_object
_bytes_address = ctypes.pythonapi.PyBytes_AsString
_bytes_address.argtypes = [ctypes.py_object]
_bytes_address.restype = ctypes.c_void_p


class _Memory:
    """A bytes object's memory as numpy takes it, writable (``__array_interface__``); the view's base, it
    keeps the bytes alive. (Not a ctypes array: each length is a ctypes type of its own, made at about
    40 us whenever a length is new, and left for the cyclic collector: an embedding server's replies
    vary in size.)"""

    __slots__ = ("__array_interface__", "owner")

    def __init__(self, owner: bytes, size: int) -> None:
        self.owner = owner
        self.__array_interface__ = {
            "data": (_bytes_address(owner), False),
            "shape": (size,),
            "typestr": "|u1",
            "version": 3,
        }


def new_bytes(size: int) -> tuple[bytes, np.ndarray]:
    """A new bytes object of ``size``, uninitialised, and a writable uint8 view of it. gRPC sends only
    ``bytes``, so a message is written into one as CPython's C code builds them: allocated, filled through
    the view, and only then handed on (the view must not be written once it is)."""
    out = _new_bytes(None, size)
    return out, np.asarray(_Memory(out, size))


def _filled_bytes(parts: list[Any], size: int) -> bytes:
    """``parts`` (bytes, C-contiguous arrays, :class:`Gather`) written one after another into a new bytes
    object of ``size`` (:func:`new_bytes`)."""
    out, view = new_bytes(size)
    at = 0
    for p in parts:
        n = _size(p)
        if isinstance(p, Gather):
            p.into(view[at : at + n])
        elif isinstance(p, np.ndarray):
            view[at : at + n] = p.reshape(-1).view(np.uint8)
        else:
            view[at : at + n] = np.frombuffer(p, dtype=np.uint8)
        at += n
    if at != size:
        raise AssertionError(f"message parts hold {at} bytes, not {size}")
    return out


def encode_message(fields: Sequence[tuple[int, Any]]) -> bytes:
    """The serialised bytes of a message given as (field number, value) in field order, as
    ``SerializeToString`` writes the same message: an int or bool is a varint field (0 and False are left
    out, as proto3 does), a list of (number, value) is an embedded message, None is an unset field, a
    :class:`Gather` is the rows it names, and anything else is an array written as a ``Tensor``. Each
    array's data is copied once, into the result."""
    parts, size, gathers = _message_parts(fields)
    if not gathers:
        return b"".join(parts)  # (a C-contiguous array is a buffer: join copies it once)
    return _filled_bytes(parts, size)


def embedded_head(number: int, size: int) -> bytes:
    """The bytes before the ``size`` bytes of an embedded message in field ``number``: its tag and length."""
    return _varint(number << 3 | 2) + _varint(size)


def _message_parts(fields: Sequence[tuple[int, Any]]) -> tuple[list[Any], int, bool]:
    """The parts of a message's bytes (bytes, arrays, :class:`Gather`), their size, and whether a
    :class:`Gather` is among them."""
    parts: list[Any] = []
    size = 0
    gathers = False
    for number, value in fields:
        if value is None:
            continue
        if isinstance(value, int | np.integer):
            if value:
                tag, varint = _varint(number << 3), _varint(int(value))
                parts += [tag, varint]
                size += len(tag) + len(varint)
            continue
        if isinstance(value, list):
            inner, inner_size, inner_gathers = _message_parts(value)
            head = embedded_head(number, inner_size)
            parts.append(head)
            parts += inner
            size += len(head) + inner_size
            gathers = gathers or inner_gathers
            continue
        if isinstance(value, Gather):
            gathers = True
        else:  # an array (or anything np.asarray takes, such as a CPU tensor)
            value = value if isinstance(value, np.ndarray) else np.asarray(value)
        tensor, tensor_size = _tensor_parts(number, value)
        parts += tensor
        size += tensor_size
    return parts, size, gathers


def serialized(message: Any) -> bytes:
    """gRPC serializer for methods whose messages may arrive already serialised (``encode_message``)."""
    return message if isinstance(message, bytes) else message.SerializeToString()


@dataclass(frozen=True)
class RawTensor:
    """A ``Tensor`` read by :func:`decode_message`: ``data`` is a view of the message bytes (no copy);
    :func:`from_tensor` reads it like a ``Tensor`` message."""

    dtype: int = 0
    shape: tuple[int, ...] = ()
    data: memoryview = memoryview(b"")


def _read_varint(buf: memoryview, at: int, end: int, field: str) -> tuple[int, int]:
    value = shift = 0
    while True:
        if at >= end or shift > 63:
            raise InvalidArgument(field, "malformed message: a varint runs past its end")
        byte = buf[at]
        value |= (byte & 0x7F) << shift
        at += 1
        shift += 7
        if byte < 0x80:
            return value, at


def _int64(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _read_fields(buf: memoryview, at: int, end: int, field: str) -> Iterator[tuple[int, int, Any]]:
    """(number, wire type, value) of each field in ``buf[at:end]``: an int, or (start, end) of its bytes."""
    while at < end:
        tag, at = _read_varint(buf, at, end, field)
        number, kind = tag >> 3, tag & 7
        if kind == 0:
            value, at = _read_varint(buf, at, end, field)
            yield number, kind, value
        elif kind == 2:
            size, at = _read_varint(buf, at, end, field)
            if at + size > end:
                raise InvalidArgument(field, f"malformed message: field {number} runs past the end")
            yield number, kind, (at, at + size)
            at += size
        elif kind in (1, 5):
            at += 8 if kind == 1 else 4
        else:
            raise InvalidArgument(field, f"malformed message: wire type {kind} of field {number}")
    if at != end:
        raise InvalidArgument(field, "malformed message: truncated")


def _read_tensor(buf: memoryview, start: int, end: int, field: str) -> RawTensor:
    dtype, shape, data = 0, [], buf[start:start]
    for number, kind, value in _read_fields(buf, start, end, field):
        if number == 1 and kind == 0:
            dtype = value
        elif number == 2 and kind == 2:  # packed dims
            at, stop = value
            while at < stop:
                dim, at = _read_varint(buf, at, stop, field)
                shape.append(_int64(dim))
        elif number == 2 and kind == 0:  # an unpacked dim (parsers must accept both)
            shape.append(_int64(value))
        elif number == 3 and kind == 2:
            data = buf[value[0] : value[1]]
    return RawTensor(dtype, tuple(shape), data)


def unwrap(data: bytes, number: int, field: str) -> memoryview | None:
    """The bytes of embedded message ``number`` when ``data`` is a message holding only that field (one
    arm of a oneof, such as ``BatchPart``'s), or None when it starts with another field; a view, no copy."""
    buf = memoryview(data)
    tag, at = _read_varint(buf, 0, len(buf), field)
    if tag != (number << 3 | 2):
        return None
    size, at = _read_varint(buf, at, len(buf), field)
    if at + size != len(buf):
        raise InvalidArgument(field, f"malformed message: field {number} is not the whole message")
    return buf[at:]


def read_shallow(data: bytes | memoryview, field: str) -> tuple[dict[int, int], dict[int, memoryview]]:
    """A serialised message's varint fields by number (int64 as protobuf writes them) and its
    length-delimited fields' bytes (views, not parsed): a few microseconds, whatever the message's size.
    :func:`read_tensor` reads one of those as a ``Tensor``."""
    buf = memoryview(data)
    scalars, spans = {}, {}
    for number, kind, value in _read_fields(buf, 0, len(buf), field):
        if kind == 0:
            scalars[number] = _int64(value)
        elif kind == 2:
            spans[number] = buf[value[0] : value[1]]
    return scalars, spans


def read_tensor(data: memoryview, field: str) -> RawTensor:
    """A serialised ``Tensor`` (such as a span of :func:`read_shallow`), its data a view."""
    return _read_tensor(data, 0, len(data), field)


def decode_message(data: bytes | memoryview, descriptor: Any) -> SimpleNamespace:
    """Reads a serialised message of type ``descriptor`` whose fields are int64 scalars and ``Tensor``
    messages (what :func:`encode_message` writes, or protobuf), without copying the tensors' bytes: each
    ``Tensor`` field becomes a :class:`RawTensor` viewing ``data``. Fields absent take their defaults;
    unknown fields are skipped, as protobuf does. Malformed bytes raise InvalidArgument."""
    where = descriptor.name
    out: dict[str, Any] = {}
    kinds = {}
    for f in descriptor.fields:
        tensor = f.message_type is not None and f.message_type.full_name == "bagpipe.v1.Tensor"
        kinds[f.number] = (f.name, tensor)
        out[f.name] = RawTensor() if tensor else 0
    buf = memoryview(data)
    for number, kind, value in _read_fields(buf, 0, len(buf), where):
        name, tensor = kinds.get(number, (None, False))
        if name is None:
            continue
        if tensor and kind == 2:
            out[name] = _read_tensor(buf, value[0], value[1], f"{where}.{name}")
        elif not tensor and kind == 0:
            out[name] = _int64(value)
        else:
            raise InvalidArgument(f"{where}.{name}", f"malformed message: wire type {kind}")
    return SimpleNamespace(**out)
