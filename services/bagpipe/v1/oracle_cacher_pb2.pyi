from bagpipe.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StreamPlansRequest(_message.Message):
    __slots__ = ("rank", "start")
    RANK_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    rank: int
    start: int
    def __init__(self, rank: _Optional[int] = ..., start: _Optional[int] = ...) -> None: ...

class Plan(_message.Message):
    __slots__ = ("batch", "keys", "slots", "ttl", "prefetch", "evict", "writeback", "slot_high_water", "dense", "labels", "inverse", "global_batch_size", "last", "lookahead")
    BATCH_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    TTL_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_FIELD_NUMBER: _ClassVar[int]
    EVICT_FIELD_NUMBER: _ClassVar[int]
    WRITEBACK_FIELD_NUMBER: _ClassVar[int]
    SLOT_HIGH_WATER_FIELD_NUMBER: _ClassVar[int]
    DENSE_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    INVERSE_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    LOOKAHEAD_FIELD_NUMBER: _ClassVar[int]
    batch: int
    keys: _tensor_pb2.Tensor
    slots: _tensor_pb2.Tensor
    ttl: _tensor_pb2.Tensor
    prefetch: _tensor_pb2.Tensor
    evict: _tensor_pb2.Tensor
    writeback: _tensor_pb2.Tensor
    slot_high_water: int
    dense: _tensor_pb2.Tensor
    labels: _tensor_pb2.Tensor
    inverse: _tensor_pb2.Tensor
    global_batch_size: int
    last: bool
    lookahead: int
    def __init__(self, batch: _Optional[int] = ..., keys: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., slots: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., ttl: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., prefetch: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., evict: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., writeback: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., slot_high_water: _Optional[int] = ..., dense: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., labels: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., inverse: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., global_batch_size: _Optional[int] = ..., last: _Optional[bool] = ..., lookahead: _Optional[int] = ...) -> None: ...

class ProgressReport(_message.Message):
    __slots__ = ("rank", "trained", "written_back")
    RANK_FIELD_NUMBER: _ClassVar[int]
    TRAINED_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_BACK_FIELD_NUMBER: _ClassVar[int]
    rank: int
    trained: int
    written_back: int
    def __init__(self, rank: _Optional[int] = ..., trained: _Optional[int] = ..., written_back: _Optional[int] = ...) -> None: ...

class ProgressAck(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
