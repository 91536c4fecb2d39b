from bagpipe.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StreamBatchesRequest(_message.Message):
    __slots__ = ("start", "stride", "end", "trainers")
    START_FIELD_NUMBER: _ClassVar[int]
    STRIDE_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    TRAINERS_FIELD_NUMBER: _ClassVar[int]
    start: int
    stride: int
    end: int
    trainers: int
    def __init__(self, start: _Optional[int] = ..., stride: _Optional[int] = ..., end: _Optional[int] = ..., trainers: _Optional[int] = ...) -> None: ...

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
