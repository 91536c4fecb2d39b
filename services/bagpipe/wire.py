"""Numpy arrays to and from ``bagpipe.v1.Tensor``: raw little-endian bytes with dtype and shape."""

from __future__ import annotations

import numpy as np

from bagpipe.errors import InvalidArgument
from bagpipe.v1 import tensor_pb2

_TO_PROTO: dict[np.dtype, tensor_pb2.DType] = {
    np.dtype("<f4"): tensor_pb2.DTYPE_FLOAT32,
    np.dtype("<i8"): tensor_pb2.DTYPE_INT64,
    np.dtype("<i4"): tensor_pb2.DTYPE_INT32,
    np.dtype("bool"): tensor_pb2.DTYPE_BOOL,
}
_FROM_PROTO = {v: k for k, v in _TO_PROTO.items()}
_NAMES = {v: k.name for k, v in _TO_PROTO.items()}


def to_tensor(array: np.ndarray) -> tensor_pb2.Tensor:
    """Encodes ``array`` (float32, int64, int32 or bool) without an intermediate Python list."""
    dtype = array.dtype.newbyteorder("<") if array.dtype.byteorder == ">" else array.dtype
    if dtype not in _TO_PROTO:
        raise TypeError(f"unsupported dtype {array.dtype}")
    data = np.ascontiguousarray(array, dtype=dtype).tobytes()
    return tensor_pb2.Tensor(dtype=_TO_PROTO[dtype], shape=list(array.shape), data=data)


def from_tensor(
    tensor: tensor_pb2.Tensor,
    field: str,
    dtype: np.dtype | type | str,
    ndim: int | None = None,
    shape: tuple[int | None, ...] | None = None,
) -> np.ndarray:
    """Decodes and validates a Tensor; raises InvalidArgument naming ``field`` on any mismatch.

    ``shape`` entries of None match any size. The result is a read-only view of the message bytes.
    """
    want = np.dtype(dtype)
    got = _FROM_PROTO.get(tensor.dtype)
    if got is None:
        raise InvalidArgument(field, f"unknown dtype {tensor.dtype}")
    if got != want:
        raise InvalidArgument(field, f"dtype must be {want.name}, got {_NAMES[tensor.dtype]}")
    dims = tuple(int(d) for d in tensor.shape)
    if any(d < 0 for d in dims):
        raise InvalidArgument(field, f"negative dimension in shape {list(dims)}")
    if ndim is not None and len(dims) != ndim:
        raise InvalidArgument(field, f"must have {ndim} dimensions, got shape {list(dims)}")
    if shape is not None and (
        len(dims) != len(shape) or any(s is not None and s != d for s, d in zip(shape, dims, strict=True))
    ):
        expect = ["*" if s is None else s for s in shape]
        raise InvalidArgument(field, f"shape must be {expect}, got {list(dims)}")
    count = int(np.prod(dims, dtype=np.int64)) if dims else 1
    if len(tensor.data) != count * want.itemsize:
        raise InvalidArgument(
            field, f"{len(tensor.data)} bytes do not hold shape {list(dims)} of {want.name}"
        )
    return np.frombuffer(tensor.data, dtype=want).reshape(dims)
