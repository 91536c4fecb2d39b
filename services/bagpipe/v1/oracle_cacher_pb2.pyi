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
    __slots__ = ("batch", "slots", "dense", "labels", "inverse", "prefetch_keys", "prefetch_slots", "private_rows", "critical", "background", "writeback_keys", "writeback_slots", "slot_high_water", "global_batch_size", "last", "lookahead", "depends_on", "occupancy", "unique_rows", "checkpoint", "checkpoint_keys", "checkpoint_slots")
    BATCH_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    DENSE_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    INVERSE_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_KEYS_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_SLOTS_FIELD_NUMBER: _ClassVar[int]
    PRIVATE_ROWS_FIELD_NUMBER: _ClassVar[int]
    CRITICAL_FIELD_NUMBER: _ClassVar[int]
    BACKGROUND_FIELD_NUMBER: _ClassVar[int]
    WRITEBACK_KEYS_FIELD_NUMBER: _ClassVar[int]
    WRITEBACK_SLOTS_FIELD_NUMBER: _ClassVar[int]
    SLOT_HIGH_WATER_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    LOOKAHEAD_FIELD_NUMBER: _ClassVar[int]
    DEPENDS_ON_FIELD_NUMBER: _ClassVar[int]
    OCCUPANCY_FIELD_NUMBER: _ClassVar[int]
    UNIQUE_ROWS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_KEYS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_SLOTS_FIELD_NUMBER: _ClassVar[int]
    batch: int
    slots: _tensor_pb2.Tensor
    dense: _tensor_pb2.Tensor
    labels: _tensor_pb2.Tensor
    inverse: _tensor_pb2.Tensor
    prefetch_keys: _tensor_pb2.Tensor
    prefetch_slots: _tensor_pb2.Tensor
    private_rows: _tensor_pb2.Tensor
    critical: Sync
    background: Sync
    writeback_keys: _tensor_pb2.Tensor
    writeback_slots: _tensor_pb2.Tensor
    slot_high_water: int
    global_batch_size: int
    last: bool
    lookahead: int
    depends_on: int
    occupancy: int
    unique_rows: int
    checkpoint: bool
    checkpoint_keys: _tensor_pb2.Tensor
    checkpoint_slots: _tensor_pb2.Tensor
    def __init__(self, batch: _Optional[int] = ..., slots: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., dense: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., labels: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., inverse: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., prefetch_keys: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., prefetch_slots: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., private_rows: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., critical: _Optional[_Union[Sync, _Mapping]] = ..., background: _Optional[_Union[Sync, _Mapping]] = ..., writeback_keys: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., writeback_slots: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., slot_high_water: _Optional[int] = ..., global_batch_size: _Optional[int] = ..., last: _Optional[bool] = ..., lookahead: _Optional[int] = ..., depends_on: _Optional[int] = ..., occupancy: _Optional[int] = ..., unique_rows: _Optional[int] = ..., checkpoint: _Optional[bool] = ..., checkpoint_keys: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., checkpoint_slots: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...

class Sync(_message.Message):
    __slots__ = ("slots", "local", "handover_slots", "handover_send", "handover_recv")
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_FIELD_NUMBER: _ClassVar[int]
    HANDOVER_SLOTS_FIELD_NUMBER: _ClassVar[int]
    HANDOVER_SEND_FIELD_NUMBER: _ClassVar[int]
    HANDOVER_RECV_FIELD_NUMBER: _ClassVar[int]
    slots: _tensor_pb2.Tensor
    local: _tensor_pb2.Tensor
    handover_slots: _tensor_pb2.Tensor
    handover_send: _tensor_pb2.Tensor
    handover_recv: _tensor_pb2.Tensor
    def __init__(self, slots: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., local: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., handover_slots: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., handover_send: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., handover_recv: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...

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
