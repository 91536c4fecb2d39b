from bagpipe.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StreamBatchesRequest(_message.Message):
    __slots__ = ("start", "stride", "end", "trainers", "slices", "oracles", "shard")
    START_FIELD_NUMBER: _ClassVar[int]
    STRIDE_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    TRAINERS_FIELD_NUMBER: _ClassVar[int]
    SLICES_FIELD_NUMBER: _ClassVar[int]
    ORACLES_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    start: int
    stride: int
    end: int
    trainers: int
    slices: int
    oracles: int
    shard: int
    def __init__(self, start: _Optional[int] = ..., stride: _Optional[int] = ..., end: _Optional[int] = ..., trainers: _Optional[int] = ..., slices: _Optional[int] = ..., oracles: _Optional[int] = ..., shard: _Optional[int] = ...) -> None: ...

class BatchPart(_message.Message):
    __slots__ = ("batch", "samples")
    BATCH_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    batch: Batch
    samples: Samples
    def __init__(self, batch: _Optional[_Union[Batch, _Mapping]] = ..., samples: _Optional[_Union[Samples, _Mapping]] = ...) -> None: ...

class Samples(_message.Message):
    __slots__ = ("batch", "dense", "labels", "inverse", "rank")
    BATCH_FIELD_NUMBER: _ClassVar[int]
    DENSE_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    INVERSE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    batch: int
    dense: _tensor_pb2.Tensor
    labels: _tensor_pb2.Tensor
    inverse: _tensor_pb2.Tensor
    rank: int
    def __init__(self, batch: _Optional[int] = ..., dense: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., labels: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., inverse: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., rank: _Optional[int] = ...) -> None: ...

class Batch(_message.Message):
    __slots__ = ("number", "dense", "labels", "keys", "inverse", "last", "users")
    NUMBER_FIELD_NUMBER: _ClassVar[int]
    DENSE_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    INVERSE_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    USERS_FIELD_NUMBER: _ClassVar[int]
    number: int
    dense: _tensor_pb2.Tensor
    labels: _tensor_pb2.Tensor
    keys: _tensor_pb2.Tensor
    inverse: _tensor_pb2.Tensor
    last: bool
    users: _tensor_pb2.Tensor
    def __init__(self, number: _Optional[int] = ..., dense: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., labels: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., keys: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., inverse: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., last: _Optional[bool] = ..., users: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...
