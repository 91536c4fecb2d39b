"""Hand-written wire bytes (encode_message / decode_message) against the generated protobuf classes."""

from __future__ import annotations

import ctypes
import gc
from typing import Any

import numpy as np
import pytest
from bagpipe.core.intrinsics import ROWS_AHEAD, gather_rows
from bagpipe.errors import InvalidArgument
from bagpipe.v1 import embedding_server_pb2 as pb
from bagpipe.v1 import tensor_pb2
from bagpipe.wire import (
    Gather,
    _varint,
    decode_message,
    encode_message,
    from_tensor,
    gather,
    new_bytes,
    to_tensor,
)

PACKED = np.arange(60, dtype=np.float32).reshape(5, 12)
CASES = [
    (PACKED[:, :8], PACKED[:, 8:]),  # column slices of one packed table (not contiguous)
    (np.zeros((0, 16), np.float32), np.zeros((0, 16), np.float32)),
    (np.ones((3, 2), np.float32), np.zeros((3, 0), np.float32)),  # SGD: no state
    (np.arange(4, dtype=">f4").reshape(2, 2), np.ones((2, 1), np.float32)),  # big-endian input
]


@pytest.mark.parametrize(("rows", "state"), CASES)
def test_encoded_reply_is_what_protobuf_serialises(rows: np.ndarray, state: np.ndarray) -> None:
    message = pb.LookupResponse(rows=to_tensor(rows), state=to_tensor(state))
    assert encode_message([(1, rows), (2, state)]) == message.SerializeToString()


@pytest.mark.parametrize(
    "array",
    [
        np.arange(7, dtype=np.int32),  # as the wire has it: sent as it is
        np.arange(12, dtype=np.int64).reshape(3, 4),
        np.zeros(0, dtype=np.uint8),
        np.array(2.5, dtype=np.float32),  # 0-d: one element
        np.arange(6, dtype="<i8")[::2],  # strided
        np.ones(3, dtype=bool),
    ],
)
def test_an_array_field_is_what_protobuf_serialises(array: np.ndarray) -> None:
    as_proto = to_tensor(np.ascontiguousarray(array))
    assert encode_message([(1, array)]) == pb.LookupResponse(rows=as_proto).SerializeToString()


@pytest.mark.parametrize("version", [0, 1, 300, -2, (1 << 62) + 5])
def test_encoded_request_scalars_match_protobuf_and_read_back(version: int) -> None:
    keys = np.array([7, 0, 1 << 40], dtype=np.int64)
    data = encode_message([(1, version), (2, keys)])
    assert data == pb.LookupRequest(shard_map_version=version, keys=to_tensor(keys)).SerializeToString()
    read = decode_message(data, pb.LookupRequest.DESCRIPTOR)
    assert read.shard_map_version == version
    assert np.array_equal(from_tensor(read.keys, "keys", np.int64, ndim=1), keys)


def test_decoding_protobuf_bytes_gives_views_not_copies() -> None:
    rows, state = CASES[0]
    data = pb.WriteBackRequest(
        shard_map_version=4, keys=to_tensor(np.arange(5)), rows=to_tensor(rows), state=to_tensor(state)
    ).SerializeToString()
    read = decode_message(data, pb.WriteBackRequest.DESCRIPTOR)
    got = from_tensor(read.rows, "rows", np.float32, shape=(5, 8))
    assert np.array_equal(got, rows) and not got.flags.owndata and not got.flags.writeable
    assert np.array_equal(from_tensor(read.state, "state", np.float32, shape=(5, 4)), state)


def test_absent_fields_take_defaults_and_unknown_ones_are_skipped() -> None:
    read = decode_message(b"", pb.LookupResponse.DESCRIPTOR)
    assert read.rows.dtype == 0 and read.rows.shape == ()
    with pytest.raises(InvalidArgument, match="rows: unknown dtype 0"):
        from_tensor(read.rows, "rows", np.float32)
    extra = encode_message([(1, np.ones((1, 2), np.float32))]) + b"\x48\x05"  # field 9, varint
    assert decode_message(extra, pb.LookupResponse.DESCRIPTOR).rows.shape == (1, 2)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"\x0a\x05\x08\x01", "runs past the end"),  # a Tensor field longer than the message
        (b"\x08", "varint runs past its end"),
        (b"\x0b", "wire type 3"),
        (b"\x08\x01", "LookupResponse.rows: malformed message: wire type 0"),  # rows as a scalar
    ],
)
def test_malformed_bytes_are_refused_naming_the_problem(data: bytes, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        decode_message(data, pb.LookupResponse.DESCRIPTOR)


def test_the_client_reads_a_packed_reply_and_one_with_rows_and_state_apart() -> None:
    """Servers reply with ``packed`` (each row then its state); one from before it sends ``rows`` and
    ``state``: the trainers' client takes either, with the same result."""
    from bagpipe.core.shard_map import ShardMap
    from bagpipe.embedding_server.client import EmbeddingClient

    keys = np.array([5, 2, 9], dtype=np.int64)
    rows, state = PACKED[:3, :8], PACKED[:3, 8:]
    client = EmbeddingClient(ShardMap.create(12, 1, num_buckets=4), {0: "127.0.0.1:1"}, dim=8, state_width=4)

    class Stub:
        def __init__(self, reply: bytes) -> None:
            self.reply = reply

        def Lookup(self, request: bytes, timeout: float) -> bytes:  # noqa: N802
            return self.reply

    try:
        for reply in (encode_message([(3, PACKED[:3])]), encode_message([(1, rows), (2, state)])):
            route = client._route
            client._route = type(route)(route.shard_map, {0: Stub(reply)})  # type: ignore[dict-item]
            got_rows, got_state = client.lookup(keys)
            assert np.array_equal(got_rows, rows) and np.array_equal(got_state, state)
        client._route = type(route)(route.shard_map, {0: Stub(encode_message([(3, PACKED[:2])]))})
        with pytest.raises(InvalidArgument, match=r"packed: shape must be \[3, 12\], got \[2, 12\]"):
            client.lookup(keys)
    finally:
        client.close()


def test_the_client_refuses_a_reply_whose_initial_rows_it_cannot_place() -> None:
    """A reply that leaves rows out as initial is read only by a client that computes them, and only with
    ascending positions inside the request; any other names the field and changes nothing."""
    from bagpipe.core.data import table_offsets
    from bagpipe.core.embedding_init import InitialRows
    from bagpipe.core.shard_map import ShardMap
    from bagpipe.embedding_server.client import EmbeddingClient

    keys = np.array([5, 2, 9], dtype=np.int64)
    offsets = table_offsets([12])
    shard_map = ShardMap.create(12, 1, num_buckets=4)

    class Stub:
        def __init__(self, reply: bytes) -> None:
            self.reply = reply

        def Lookup(self, request: bytes, timeout: float) -> bytes:  # noqa: N802
            return self.reply

    def reply(initial: list[int], rows: int) -> bytes:
        return encode_message([(3, PACKED[:rows]), (4, np.array(initial, dtype=np.int64))])

    plain = EmbeddingClient(shard_map, {0: "127.0.0.1:1"}, dim=8, state_width=4)
    computes = EmbeddingClient(shard_map, {0: "127.0.0.1:1"}, 8, 4, initial=InitialRows(offsets, 8, 0))
    try:
        cases = [
            (plain, reply([1], 2), "initial: rows left out of a reply to a client that computes none"),
            (computes, reply([2, 1], 1), r"initial: positions must ascend within \[0, 3\)"),
            (computes, reply([0, 3], 1), r"initial: positions must ascend within \[0, 3\)"),
            (computes, reply([1], 1), r"packed: shape must be \[2, 12\], got \[1, 12\]"),
        ]
        for client, data, message in cases:
            route = client._route
            client._route = type(route)(route.shard_map, {0: Stub(data)})  # type: ignore[dict-item]
            with pytest.raises(InvalidArgument, match=message):
                client.lookup(keys)
        computes._route = type(route)(route.shard_map, {0: Stub(reply([1], 2))})  # type: ignore[dict-item]
        got_rows, got_state = computes.lookup(keys)
        assert np.array_equal(got_rows[[0, 2]], PACKED[:2, :8]) and np.array_equal(
            got_state[[0, 2]], PACKED[:2, 8:]
        )
        assert (
            np.array_equal(got_rows[1], InitialRows(offsets, 8, 0).rows(keys[1:2])[0])
            and not got_state[1].any()
        )
    finally:
        plain.close()
        computes.close()


@pytest.mark.parametrize("width", [0, 1, 7, 32])
@pytest.mark.parametrize("before", [[], [(1, 5)], [(1, 300), (2, np.arange(3))]])
def test_rows_gathered_into_a_message_are_the_bytes_of_the_gathered_array(
    width: int, before: list[tuple[int, Any]]
) -> None:
    """``Gather`` fields (a lookup's rows, a write-back's) are written straight into the message, at any
    offset (unaligned for float32 too), with the bytes ``encode_message`` writes for the gathered array."""
    rng = np.random.default_rng(width)
    table = rng.random((500, width), dtype=np.float32)
    for index in (rng.choice(500, 200, replace=False), np.zeros(0, dtype=np.int64), np.array([499, 0, 499])):
        index = index.astype(np.int64)
        gathered = table[index]
        got = encode_message([*before, (3, Gather(table, index))])
        assert got == encode_message([*before, (3, gathered)])
        nested = encode_message([*before, (3, [(1, Gather(table, index)), (2, 4)])])  # (inside a message)
        assert type(nested) is bytes and nested == encode_message([*before, (3, [(1, gathered), (2, 4)])])
        assert np.array_equal(np.asarray(Gather(table, index)), gathered)
    ints = np.arange(12, dtype=np.int64).reshape(4, 3)  # (other types: numpy's take)
    assert encode_message([(3, Gather(ints, np.array([2, 0])))]) == encode_message([(3, ints[[2, 0]])])
    with pytest.raises(ValueError, match="2-D and C-contiguous"):
        encode_message([(3, Gather(np.zeros((4, 6), np.float32)[:, ::2], np.arange(2)))])
    strided = np.arange(24, dtype=np.float32).reshape(4, 6)[:, ::2]  # (``gather`` takes any table)
    assert encode_message([(3, gather(strided, np.array([3, 1])))]) == encode_message([(3, strided[[3, 1]])])
    assert isinstance(gather(table, np.array([1])), Gather)


def test_the_compiled_gather_copies_the_rows_take_copies() -> None:
    rng = np.random.default_rng(0)
    table = rng.random((10_000, 32), dtype=np.float32)
    for n in (0, 1, ROWS_AHEAD, ROWS_AHEAD + 1, 5_000):
        index = rng.integers(0, table.shape[0], n)
        out = np.full((n, 32), np.nan, dtype=np.float32)
        gather_rows(table, index, out)
        assert np.array_equal(out, table.take(index, axis=0))


@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 4097, 70_000, 1 << 20])
def test_a_large_array_field_is_what_protobuf_serialises(size: int) -> None:
    """Sizes around and past the varints of one lookup (2^14) and two (2^28 bytes are not built here)."""
    rows = np.arange(4 * size, dtype=np.float32).reshape(size, 4)
    message = pb.LookupResponse(rows=to_tensor(rows), state=to_tensor(rows[:, :1]))
    assert encode_message([(1, rows), (2, rows[:, :1])]) == message.SerializeToString()


def test_varints_of_every_width_are_protobufs() -> None:
    """A varint of any value, as protobuf writes it (int64: a negative value in ten bytes)."""
    values = [
        0,
        1,
        127,
        128,
        (1 << 14) - 1,
        1 << 14,
        (1 << 21) + 5,
        (1 << 28) - 1,
        1 << 28,
        1 << 40,
        -1,
        -(1 << 40),
    ]
    values += np.random.default_rng(0).integers(0, 1 << 30, size=200).tolist()
    for value in values:
        # (a Tensor of one dimension: its shape's field is a tag, a length and the dimension's varint)
        want = tensor_pb2.Tensor(shape=[value]).SerializeToString()
        assert want[2 : 2 + want[1]] == _varint(value), value


def test_a_new_message_is_written_through_its_view_and_makes_no_ctypes_type_a_size() -> None:
    """``new_bytes`` gives a bytes object and a writable view of it that keeps it alive; a size it has not
    seen before makes no ctypes array type (each took about 40 us to make, and was garbage for the cyclic
    collector afterwards)."""
    gc.disable()  # (so that no collection hides a type made in the loop)
    try:
        before = len(ctypes.Array.__subclasses__())
        for size in range(70_001, 70_301):
            out, view = new_bytes(size)
            view[:] = size % 251
            assert out == bytes([size % 251]) * size
        assert len(ctypes.Array.__subclasses__()) == before
    finally:
        gc.enable()
    out, view = new_bytes(3)
    view[:] = [1, 2, 3]
    del out
    gc.collect()
    assert view.tobytes() == b"\x01\x02\x03"  # (the view holds the bytes)
    out, view = new_bytes(0)
    assert out == b"" and view.size == 0
