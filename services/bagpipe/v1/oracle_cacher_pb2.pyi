from bagpipe.v1 import data_processor_pb2 as _data_processor_pb2
from bagpipe.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StreamFetchesRequest(_message.Message):
    __slots__ = ("start",)
    START_FIELD_NUMBER: _ClassVar[int]
    start: int
    def __init__(self, start: _Optional[int] = ...) -> None: ...

class Fetches(_message.Message):
    __slots__ = ("batch", "keys", "last", "trained", "dispatched", "fetched")
    BATCH_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    TRAINED_FIELD_NUMBER: _ClassVar[int]
    DISPATCHED_FIELD_NUMBER: _ClassVar[int]
    FETCHED_FIELD_NUMBER: _ClassVar[int]
    batch: int
    keys: _tensor_pb2.Tensor
    last: bool
    trained: int
    dispatched: int
    fetched: int
    def __init__(self, batch: _Optional[int] = ..., keys: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., last: _Optional[bool] = ..., trained: _Optional[int] = ..., dispatched: _Optional[int] = ..., fetched: _Optional[int] = ...) -> None: ...

class StreamPlansRequest(_message.Message):
    __slots__ = ("rank", "start")
    RANK_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    rank: int
    start: int
    def __init__(self, rank: _Optional[int] = ..., start: _Optional[int] = ...) -> None: ...

class PlanPart(_message.Message):
    __slots__ = ("rows", "plan", "samples")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    rows: PlanRows
    plan: Plan
    samples: _data_processor_pb2.Samples
    def __init__(self, rows: _Optional[_Union[PlanRows, _Mapping]] = ..., plan: _Optional[_Union[Plan, _Mapping]] = ..., samples: _Optional[_Union[_data_processor_pb2.Samples, _Mapping]] = ...) -> None: ...

class Plan(_message.Message):
    __slots__ = ("batch", "slot_high_water", "global_batch_size", "last", "lookahead", "depends_on", "occupancy", "checkpoint", "checkpoint_keys", "checkpoint_slots", "prefetch_mine", "handover_send", "handover_recv")
    BATCH_FIELD_NUMBER: _ClassVar[int]
    SLOT_HIGH_WATER_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    LOOKAHEAD_FIELD_NUMBER: _ClassVar[int]
    DEPENDS_ON_FIELD_NUMBER: _ClassVar[int]
    OCCUPANCY_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_KEYS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_SLOTS_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_MINE_FIELD_NUMBER: _ClassVar[int]
    HANDOVER_SEND_FIELD_NUMBER: _ClassVar[int]
    HANDOVER_RECV_FIELD_NUMBER: _ClassVar[int]
    batch: int
    slot_high_water: int
    global_batch_size: int
    last: bool
    lookahead: int
    depends_on: int
    occupancy: int
    checkpoint: bool
    checkpoint_keys: _tensor_pb2.Tensor
    checkpoint_slots: _tensor_pb2.Tensor
    prefetch_mine: _tensor_pb2.Tensor
    handover_send: _tensor_pb2.Tensor
    handover_recv: _tensor_pb2.Tensor
    def __init__(self, batch: _Optional[int] = ..., slot_high_water: _Optional[int] = ..., global_batch_size: _Optional[int] = ..., last: _Optional[bool] = ..., lookahead: _Optional[int] = ..., depends_on: _Optional[int] = ..., occupancy: _Optional[int] = ..., checkpoint: _Optional[bool] = ..., checkpoint_keys: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., checkpoint_slots: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., prefetch_mine: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., handover_send: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., handover_recv: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...

class PlanRows(_message.Message):
    __slots__ = ("slots", "users", "sync", "prefetch", "prefetch_keys", "evict", "evict_keys", "evict_writer", "handover_slots", "handover_critical", "batch", "prefetch_first", "first_since")
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    USERS_FIELD_NUMBER: _ClassVar[int]
    SYNC_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_KEYS_FIELD_NUMBER: _ClassVar[int]
    EVICT_FIELD_NUMBER: _ClassVar[int]
    EVICT_KEYS_FIELD_NUMBER: _ClassVar[int]
    EVICT_WRITER_FIELD_NUMBER: _ClassVar[int]
    HANDOVER_SLOTS_FIELD_NUMBER: _ClassVar[int]
    HANDOVER_CRITICAL_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_FIRST_FIELD_NUMBER: _ClassVar[int]
    FIRST_SINCE_FIELD_NUMBER: _ClassVar[int]
    slots: _tensor_pb2.Tensor
    users: _tensor_pb2.Tensor
    sync: _tensor_pb2.Tensor
    prefetch: _tensor_pb2.Tensor
    prefetch_keys: _tensor_pb2.Tensor
    evict: _tensor_pb2.Tensor
    evict_keys: _tensor_pb2.Tensor
    evict_writer: _tensor_pb2.Tensor
    handover_slots: _tensor_pb2.Tensor
    handover_critical: _tensor_pb2.Tensor
    batch: int
    prefetch_first: _tensor_pb2.Tensor
    first_since: int
    def __init__(self, slots: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., users: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., sync: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., prefetch: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., prefetch_keys: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., evict: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., evict_keys: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., evict_writer: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., handover_slots: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., handover_critical: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., batch: _Optional[int] = ..., prefetch_first: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., first_since: _Optional[int] = ...) -> None: ...

class ProgressReport(_message.Message):
    __slots__ = ("rank", "trained", "written_back", "fetched", "fetch_only")
    RANK_FIELD_NUMBER: _ClassVar[int]
    TRAINED_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_BACK_FIELD_NUMBER: _ClassVar[int]
    FETCHED_FIELD_NUMBER: _ClassVar[int]
    FETCH_ONLY_FIELD_NUMBER: _ClassVar[int]
    rank: int
    trained: int
    written_back: int
    fetched: int
    fetch_only: bool
    def __init__(self, rank: _Optional[int] = ..., trained: _Optional[int] = ..., written_back: _Optional[int] = ..., fetched: _Optional[int] = ..., fetch_only: _Optional[bool] = ...) -> None: ...

class ProgressAck(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
