from bagpipe.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LookupRequest(_message.Message):
    __slots__ = ("shard_map_version", "keys", "init_fingerprint", "ask_untouched")
    SHARD_MAP_VERSION_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    INIT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    ASK_UNTOUCHED_FIELD_NUMBER: _ClassVar[int]
    shard_map_version: int
    keys: _tensor_pb2.Tensor
    init_fingerprint: int
    ask_untouched: bool
    def __init__(self, shard_map_version: _Optional[int] = ..., keys: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., init_fingerprint: _Optional[int] = ..., ask_untouched: _Optional[bool] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("rows", "state", "packed", "initial", "untouched")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PACKED_FIELD_NUMBER: _ClassVar[int]
    INITIAL_FIELD_NUMBER: _ClassVar[int]
    UNTOUCHED_FIELD_NUMBER: _ClassVar[int]
    rows: _tensor_pb2.Tensor
    state: _tensor_pb2.Tensor
    packed: _tensor_pb2.Tensor
    initial: _tensor_pb2.Tensor
    untouched: bool
    def __init__(self, rows: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., state: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., packed: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., initial: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., untouched: _Optional[bool] = ...) -> None: ...

class WriteBackRequest(_message.Message):
    __slots__ = ("shard_map_version", "keys", "rows", "state")
    SHARD_MAP_VERSION_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    shard_map_version: int
    keys: _tensor_pb2.Tensor
    rows: _tensor_pb2.Tensor
    state: _tensor_pb2.Tensor
    def __init__(self, shard_map_version: _Optional[int] = ..., keys: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., rows: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., state: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...

class WriteBackResponse(_message.Message):
    __slots__ = ("rows",)
    ROWS_FIELD_NUMBER: _ClassVar[int]
    rows: int
    def __init__(self, rows: _Optional[int] = ...) -> None: ...

class SnapshotRequest(_message.Message):
    __slots__ = ("shard_map_version", "directory", "next_batch", "full")
    SHARD_MAP_VERSION_FIELD_NUMBER: _ClassVar[int]
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    NEXT_BATCH_FIELD_NUMBER: _ClassVar[int]
    FULL_FIELD_NUMBER: _ClassVar[int]
    shard_map_version: int
    directory: str
    next_batch: int
    full: bool
    def __init__(self, shard_map_version: _Optional[int] = ..., directory: _Optional[str] = ..., next_batch: _Optional[int] = ..., full: _Optional[bool] = ...) -> None: ...

class SnapshotResponse(_message.Message):
    __slots__ = ("file", "rows", "bytes")
    FILE_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    file: str
    rows: int
    bytes: int
    def __init__(self, file: _Optional[str] = ..., rows: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...

class PrepareMigrationRequest(_message.Message):
    __slots__ = ("shard_map", "addresses", "rows_per_second", "current_shard_map", "attempt")
    class AddressesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: str
        def __init__(self, key: _Optional[int] = ..., value: _Optional[str] = ...) -> None: ...
    SHARD_MAP_FIELD_NUMBER: _ClassVar[int]
    ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    ROWS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    CURRENT_SHARD_MAP_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    shard_map: str
    addresses: _containers.ScalarMap[int, str]
    rows_per_second: float
    current_shard_map: str
    attempt: int
    def __init__(self, shard_map: _Optional[str] = ..., addresses: _Optional[_Mapping[int, str]] = ..., rows_per_second: _Optional[float] = ..., current_shard_map: _Optional[str] = ..., attempt: _Optional[int] = ...) -> None: ...

class PrepareMigrationResponse(_message.Message):
    __slots__ = ("staying_rows", "leaving_rows", "incoming_buckets")
    STAYING_ROWS_FIELD_NUMBER: _ClassVar[int]
    LEAVING_ROWS_FIELD_NUMBER: _ClassVar[int]
    INCOMING_BUCKETS_FIELD_NUMBER: _ClassVar[int]
    staying_rows: int
    leaving_rows: int
    incoming_buckets: int
    def __init__(self, staying_rows: _Optional[int] = ..., leaving_rows: _Optional[int] = ..., incoming_buckets: _Optional[int] = ...) -> None: ...

class TransferRequest(_message.Message):
    __slots__ = ("shard_map_version", "attempt")
    SHARD_MAP_VERSION_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    shard_map_version: int
    attempt: int
    def __init__(self, shard_map_version: _Optional[int] = ..., attempt: _Optional[int] = ...) -> None: ...

class TransferResponse(_message.Message):
    __slots__ = ("rows_sent", "bytes_sent", "rows_copied")
    ROWS_SENT_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    ROWS_COPIED_FIELD_NUMBER: _ClassVar[int]
    rows_sent: int
    bytes_sent: int
    rows_copied: int
    def __init__(self, rows_sent: _Optional[int] = ..., bytes_sent: _Optional[int] = ..., rows_copied: _Optional[int] = ...) -> None: ...

class ReceiveRequest(_message.Message):
    __slots__ = ("shard_map_version", "from_shard", "keys", "rows", "state", "last", "changed_keys", "attempt")
    SHARD_MAP_VERSION_FIELD_NUMBER: _ClassVar[int]
    FROM_SHARD_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    CHANGED_KEYS_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    shard_map_version: int
    from_shard: int
    keys: _tensor_pb2.Tensor
    rows: _tensor_pb2.Tensor
    state: _tensor_pb2.Tensor
    last: bool
    changed_keys: _tensor_pb2.Tensor
    attempt: int
    def __init__(self, shard_map_version: _Optional[int] = ..., from_shard: _Optional[int] = ..., keys: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., rows: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., state: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., last: _Optional[bool] = ..., changed_keys: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., attempt: _Optional[int] = ...) -> None: ...

class ReceiveResponse(_message.Message):
    __slots__ = ("rows",)
    ROWS_FIELD_NUMBER: _ClassVar[int]
    rows: int
    def __init__(self, rows: _Optional[int] = ...) -> None: ...

class SealRequest(_message.Message):
    __slots__ = ("shard_map_version", "attempt")
    SHARD_MAP_VERSION_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    shard_map_version: int
    attempt: int
    def __init__(self, shard_map_version: _Optional[int] = ..., attempt: _Optional[int] = ...) -> None: ...

class SealResponse(_message.Message):
    __slots__ = ("rows_resent", "bytes_resent", "seconds")
    ROWS_RESENT_FIELD_NUMBER: _ClassVar[int]
    BYTES_RESENT_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    rows_resent: int
    bytes_resent: int
    seconds: float
    def __init__(self, rows_resent: _Optional[int] = ..., bytes_resent: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class AbortMigrationRequest(_message.Message):
    __slots__ = ("shard_map_version", "attempt")
    SHARD_MAP_VERSION_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    shard_map_version: int
    attempt: int
    def __init__(self, shard_map_version: _Optional[int] = ..., attempt: _Optional[int] = ...) -> None: ...

class AbortMigrationResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
