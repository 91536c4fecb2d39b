from bagpipe.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LookupRequest(_message.Message):
    __slots__ = ("shard_map_version", "keys")
    SHARD_MAP_VERSION_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    shard_map_version: int
    keys: _tensor_pb2.Tensor
    def __init__(self, shard_map_version: _Optional[int] = ..., keys: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("rows", "state")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    rows: _tensor_pb2.Tensor
    state: _tensor_pb2.Tensor
    def __init__(self, rows: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., state: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...

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
    __slots__ = ("shard_map_version", "directory", "next_batch")
    SHARD_MAP_VERSION_FIELD_NUMBER: _ClassVar[int]
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    NEXT_BATCH_FIELD_NUMBER: _ClassVar[int]
    shard_map_version: int
    directory: str
    next_batch: int
    def __init__(self, shard_map_version: _Optional[int] = ..., directory: _Optional[str] = ..., next_batch: _Optional[int] = ...) -> None: ...

class SnapshotResponse(_message.Message):
    __slots__ = ("file", "rows", "bytes")
    FILE_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    file: str
    rows: int
    bytes: int
    def __init__(self, file: _Optional[str] = ..., rows: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...
