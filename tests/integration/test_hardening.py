"""No client can corrupt or stall a job: real gRPC servers refuse unauthenticated calls (and, with mutual TLS,
strangers), oversized requests
and out-of-domain values, a seeded fuzz of mutated requests leaves every server alive and unchanged, SIGTERM
stops a service with exit 0, and bad flags or files stop ``bagpipe run`` before anything starts."""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from bagpipe import cli, security, serving, tls
from bagpipe.control.registry import Registry
from bagpipe.core.data import table_offsets
from bagpipe.core.plans import MAX_TRAINERS
from bagpipe.core.shard_map import ShardMap
from bagpipe.data_processor.config import DataProcessorConfig, SourceConfig
from bagpipe.data_processor.files import CriteoConfig, CriteoTSVSource
from bagpipe.data_processor.server import create_server as create_data_processor
from bagpipe.embedding_server.caps import request_caps
from bagpipe.embedding_server.client import MAX_ROWS_PER_RPC
from bagpipe.embedding_server.server import create_server as create_embedding_server
from bagpipe.embedding_server.shard_store import ShardStore
from bagpipe.local.redis_server import RedisServer
from bagpipe.local.validate import check_inputs
from bagpipe.oracle_cacher.config import OracleConfig
from bagpipe.oracle_cacher.server import Oracle
from bagpipe.oracle_cacher.server import create_server as create_oracle
from bagpipe.v1 import control_pb2, control_pb2_grpc, data_processor_pb2, data_processor_pb2_grpc, tensor_pb2
from bagpipe.v1 import embedding_server_pb2 as epb
from bagpipe.v1 import embedding_server_pb2_grpc as epb_grpc
from bagpipe.v1 import oracle_cacher_pb2 as opb
from bagpipe.v1 import oracle_cacher_pb2_grpc as opb_grpc
from bagpipe.wire import to_tensor
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.certificates import certificates

SECRET = "test-secret-0123456789"
DIM = 4


def _store() -> ShardStore:
    return ShardStore(ShardMap.create(80, 1, num_buckets=8), 0, table_offsets([50, 30]), DIM, DIM, seed=1)


async def _code(call) -> grpc.StatusCode:
    try:
        result = call()
        if hasattr(result, "__aiter__"):
            async for _ in result:
                pass
        else:
            await result
    except grpc.aio.AioRpcError as e:
        return e.code()
    return grpc.StatusCode.OK


# ---- authentication


async def _unauthenticated_calls_are_refused() -> None:
    store = _store()
    before = store.weights.copy()
    server, port, control, _ = await create_embedding_server(store)
    try:
        keys = to_tensor(np.array([1, 2], dtype=np.int64))
        rows = to_tensor(np.full((2, DIM), 0.5, dtype=np.float32))
        write = epb.WriteBackRequest(shard_map_version=1, keys=keys, rows=rows, state=rows)
        address = f"127.0.0.1:{port}"
        for metadata in (None, [(security.SECRET_KEY, "wrong")]):
            async with grpc.aio.insecure_channel(address) as ch:
                stub = epb_grpc.EmbeddingServerStub(ch)
                assert (
                    await _code(lambda s=stub, m=metadata: s.WriteBack(write, metadata=m))
                    == grpc.StatusCode.UNAUTHENTICATED
                )
                assert (
                    await _code(
                        lambda s=stub, m=metadata: s.Lookup(
                            epb.LookupRequest(shard_map_version=1, keys=keys), metadata=m
                        )
                    )
                    == grpc.StatusCode.UNAUTHENTICATED
                )
                shutdown = control_pb2_grpc.ControlStub(ch).Shutdown
                assert await _code(
                    lambda f=shutdown, m=metadata: f(control_pb2.ShutdownRequest(), metadata=m)
                ) == (grpc.StatusCode.UNAUTHENTICATED)
                # kubelet probes cannot send metadata: health stays open
                reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""))
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
        assert not control.stop.is_set() and np.array_equal(store.weights, before)
        async with serving.aio_channel(address) as ch:  # the job's own clients carry the secret
            await epb_grpc.EmbeddingServerStub(ch).WriteBack(write, timeout=5)
            await control_pb2_grpc.ControlStub(ch).Shutdown(
                control_pb2.ShutdownRequest(reason="test"), timeout=5
            )
        assert control.stop.is_set() and not np.array_equal(store.weights, before)
    finally:  # (a server left running is collected later, and its shutdown then hangs)
        await server.stop(None)


def test_calls_without_the_job_secret_are_refused(monkeypatch) -> None:
    monkeypatch.setenv(security.JOB_SECRET_ENV, SECRET)
    asyncio.run(_unauthenticated_calls_are_refused())


def test_redis_requires_the_password(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(security.REDIS_PASSWORD_ENV, "pw-" + SECRET)
    redis_server = RedisServer(tmp_path)
    try:
        assert "requirepass" not in " ".join(redis_server.proc.args)  # not on the command line
        assert Registry(redis_server.url, "job").ping()
        monkeypatch.delenv(security.REDIS_PASSWORD_ENV)
        import redis

        with pytest.raises(redis.AuthenticationError):
            Registry(redis_server.url, "job").ping()
    finally:
        redis_server.stop()


# ---- limits and values


async def _limits_and_values() -> None:
    store = _store()
    before = (store.weights.copy(), store.state.copy())
    server, port, _, _ = await create_embedding_server(store)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = epb_grpc.EmbeddingServerStub(ch)
            # a huge lookup is refused from its declared shape, before anything is decoded or allocated
            huge = tensor_pb2.Tensor(dtype=tensor_pb2.DTYPE_INT64, shape=[1 << 30], data=b"")
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Lookup(epb.LookupRequest(shard_map_version=1, keys=huge), timeout=5)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details() == (
                f"keys: 1073741824 keys in one request; a client sends at most {MAX_ROWS_PER_RPC}"
            )
            keys = np.array([1, 2], dtype=np.int64)
            ok = np.full((2, DIM), 0.5, dtype=np.float32)
            for rows, state, message in (
                (
                    np.full((2, DIM), 3e38, dtype=np.float32),
                    ok,
                    "rows: key 1: value 3e+38 (must be at most 1e+06",
                ),
                (ok, -ok, "state: key 1: value -0.5 (must be finite and >= 0)"),
                (ok * np.inf, ok, "rows: key 1: value inf"),
            ):
                request = epb.WriteBackRequest(
                    shard_map_version=1, keys=to_tensor(keys), rows=to_tensor(rows), state=to_tensor(state)
                )
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.WriteBack(request, timeout=5)
                assert (
                    err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                    and err.value.details().startswith(message)
                )
        assert np.array_equal(store.weights, before[0]) and np.array_equal(store.state, before[1])
    finally:  # (a server left running is collected later, and its shutdown then hangs)
        await server.stop(None)


def test_oversized_requests_and_out_of_domain_values_are_refused_and_change_nothing() -> None:
    asyncio.run(_limits_and_values())


# ---- fuzz: mutated requests get a defined status, and change nothing


def _corrupt_tensor(rng: random.Random, t: tensor_pb2.Tensor) -> tensor_pb2.Tensor:
    t = tensor_pb2.Tensor.FromString(t.SerializeToString())
    choice = rng.randrange(6)
    if choice == 0:
        t.dtype = rng.choice([tensor_pb2.DTYPE_INT32, tensor_pb2.DTYPE_BOOL, 99])
    elif choice == 1:
        t.shape.append(rng.randrange(0, 5))
    elif choice == 2:
        cut = rng.randrange(1, len(t.data) + 1)  # a wrong length: bytes missing or extra
        t.data = t.data[:-cut] if rng.random() < 0.5 else t.data + b"x" * cut
    elif choice == 3:
        del t.shape[:]
        t.shape.extend([rng.choice([-1, 1 << 40, 7])])
    elif choice == 4:
        t.data = bytes(rng.randrange(256) for _ in range(len(t.data)))  # keys out of range, or NaN rows
        t.shape[0] = t.shape[0] + 1
    else:
        t.Clear()
        t.dtype = 99
    return t


def _bad_embedding_request(rng: random.Random) -> tuple[str, object]:
    keys = np.array(rng.sample(range(80), 4), dtype=np.int64)
    rows = np.full((4, DIM), 0.25, dtype=np.float32)
    kind = rng.randrange(8)
    version = 1 if rng.random() < 0.7 else rng.choice([0, 2, -5, 1 << 40])
    if kind == 0:
        msg = epb.LookupRequest(shard_map_version=version, keys=to_tensor(keys))
        if version == 1:
            msg.keys.CopyFrom(_corrupt_tensor(rng, msg.keys))
        return "Lookup", msg
    if kind in (1, 2):
        msg = epb.WriteBackRequest(
            shard_map_version=version, keys=to_tensor(keys), rows=to_tensor(rows), state=to_tensor(rows)
        )
        if version == 1:
            field = rng.choice(["keys", "rows", "state"])
            getattr(msg, field).CopyFrom(_corrupt_tensor(rng, getattr(msg, field)))
        return "WriteBack", msg
    if kind == 3:
        return "Snapshot", epb.SnapshotRequest(
            shard_map_version=rng.choice([0, 2, 7]), directory="/tmp/x", next_batch=1
        )
    if kind == 4:
        text = rng.choice(
            [
                "",
                "{",
                "[]",
                '{"version": 2}',
                ShardMap.create(81, 2).to_json(),
                ShardMap.create(80, 2, num_buckets=8).to_json(),
            ]
        )
        return "PrepareMigration", epb.PrepareMigrationRequest(
            shard_map=text, rows_per_second=rng.choice([0, -1])
        )
    if kind == 5:
        return "Receive", epb.ReceiveRequest(
            shard_map_version=rng.randrange(0, 4), from_shard=rng.randrange(-2, 3), keys=to_tensor(keys)
        )
    if kind == 6:
        return "Seal", epb.SealRequest(shard_map_version=rng.randrange(0, 5))
    return "Transfer", epb.TransferRequest(shard_map_version=rng.randrange(0, 5))


async def _fuzz(count: int) -> None:
    rng = random.Random(1234)
    store = _store()
    before = (store.weights.tobytes(), store.state.tobytes(), store.shard_map.to_json())
    server, port, _, _ = await create_embedding_server(store)
    caps = request_caps(store)
    oracle = Oracle(OracleConfig(tuple([10] * 26), 16, 2, 2, 1, 6))
    oracle_server, oracle_port, _, _ = await create_oracle(oracle)
    oracle_before = (list(oracle.written_back), list(oracle.trained), dict(oracle.owners))
    processor_server, processor_port, _, _ = await create_data_processor(
        DataProcessorConfig(SourceConfig("synthetic", tuple([10] * 26)), 12, 0)
    )
    # a server of a job with a secret, which the fuzz does not know: every call a stranger's
    guarded_store = _store()
    guarded_before = (guarded_store.weights.tobytes(), guarded_store.state.tobytes())
    os.environ[security.JOB_SECRET_ENV] = SECRET
    try:
        guarded, guarded_port, _, _ = await create_embedding_server(guarded_store)
    finally:
        del os.environ[security.JOB_SECRET_ENV]
    try:
        stranger = grpc.aio.insecure_channel(
            f"127.0.0.1:{guarded_port}", options=[("grpc.max_send_message_length", 64 << 20)]
        )
        defined = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION}
        seen: dict[grpc.StatusCode, int] = {}
        async with (
            grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch,
            grpc.aio.insecure_channel(f"127.0.0.1:{oracle_port}") as och,
        ):
            stub = epb_grpc.EmbeddingServerStub(ch)
            ostub = opb_grpc.OracleCacherStub(och)
            pch = grpc.aio.insecure_channel(f"127.0.0.1:{processor_port}")
            pstub = data_processor_pb2_grpc.DataProcessorStub(pch)
            raw = [
                ch.unary_unary(f"/bagpipe.v1.EmbeddingServer/{m}") for m in ("Lookup", "WriteBack", "Seal")
            ]
            for i in range(count):
                method, request = _bad_embedding_request(rng)
                code = await _code(lambda m=method, r=request: getattr(stub, m)(r, timeout=5))
                assert code in defined, f"request {i}: {method} {request} -> {code}"
                seen[code] = seen.get(code, 0) + 1
                # the oracle: progress never sent, or from ranks that do not exist; plan streams of no rank
                if rng.random() < 0.5:
                    report = opb.ProgressReport(
                        rank=rng.randrange(-3, 5),
                        trained=rng.randrange(-9, 1 << 40),
                        written_back=rng.randrange(0, 1 << 40),
                    )
                    code = await _code(lambda r=report: ostub.ReportProgress(r, timeout=5))
                else:
                    plans = opb.StreamPlansRequest(
                        rank=rng.choice([-1, 2, 9, 1 << 30]), start=rng.randrange(-5, 5)
                    )
                    code = await _code(lambda r=plans: ostub.StreamPlans(r, timeout=5))
                assert code == grpc.StatusCode.INVALID_ARGUMENT, f"oracle request {i} -> {code}"
                # a data processor: ranges, strides, trainer counts and slices it cannot serve
                bad = rng.randrange(4)
                stream = data_processor_pb2.StreamBatchesRequest(
                    start=rng.randrange(-9, 0) if bad == 0 else rng.randrange(0, 9),
                    stride=rng.randrange(-3, 1) if bad == 1 else rng.randrange(1, 4),
                    end=rng.randrange(0, 20),
                    trainers=rng.choice([-1, 5, 7, MAX_TRAINERS + 1, 1 << 20])
                    if bad == 2
                    else rng.randrange(0, 4),
                    slices=rng.choice([-1, 5, 7, MAX_TRAINERS + 1]) if bad == 3 else rng.choice([0, 1, 2, 4]),
                )
                code = await _code(lambda r=stream: pstub.StreamBatches(r, timeout=5))
                assert code == grpc.StatusCode.INVALID_ARGUMENT, (
                    f"data processor request {i}: {stream} -> {code}"
                )
                if i % 10 == 0:  # bytes that are no message at all
                    junk = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
                    call = rng.choice(raw)
                    code = await _code(lambda f=call, j=junk: f(j, timeout=5))
                    assert code in defined | {grpc.StatusCode.OK}, (code, junk)
                    # and more than the method can carry: refused from its size, undecoded
                    name = rng.choice(["Lookup", "Seal", "Snapshot"])
                    cap = caps.get(name, security.SMALL_REQUEST_BYTES)
                    over = bytes(rng.randrange(cap + 1, 2 * cap))
                    call = ch.unary_unary(f"/bagpipe.v1.EmbeddingServer/{name}")
                    code = await _code(lambda f=call, o=over: f(o, timeout=5))
                    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, (name, len(over), code)
                    # without the secret, any size: refused unread
                    name = rng.choice(["Lookup", "WriteBack", "Receive", "Seal"])
                    junk = bytes(rng.randrange(1, 16 << 20))
                    call = stranger.unary_unary(f"/bagpipe.v1.EmbeddingServer/{name}")
                    code = await _code(lambda f=call, j=junk: f(j, timeout=10))
                    assert code == grpc.StatusCode.UNAUTHENTICATED, (name, len(junk), code)
        assert (store.weights.tobytes(), store.state.tobytes(), store.shard_map.to_json()) == before
        assert store.migration is None
        assert (list(oracle.written_back), list(oracle.trained)) == oracle_before[:2]
        assert len(seen) == 2, seen  # both kinds of refusal were exercised
        # and every server still answers a good request
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            good = epb.LookupRequest(shard_map_version=1, keys=to_tensor(np.arange(80, dtype=np.int64)))
            await epb_grpc.EmbeddingServerStub(ch).Lookup(good, timeout=5)
        batches = [
            p.batch
            async for p in pstub.StreamBatches(
                data_processor_pb2.StreamBatchesRequest(start=0, stride=1, end=2)
            )
        ]
        assert [b.number for b in batches] == [0, 1]
        await pch.close()
        await stranger.close()
        assert (guarded_store.weights.tobytes(), guarded_store.state.tobytes()) == guarded_before
    finally:  # (a server left running is collected later, and its shutdown then hangs)
        await guarded.stop(None)
        await processor_server.stop(None)
        await server.stop(None)
        await oracle_server.stop(None)


def test_a_seeded_fuzz_of_bad_requests_gets_defined_statuses_and_changes_nothing() -> None:
    asyncio.run(_fuzz(1200))


# ---- shutdown


def test_sigterm_stops_a_service_gracefully_with_exit_0(tmp_path: Path) -> None:
    redis_server = RedisServer(tmp_path)
    try:
        registry = Registry(redis_server.url, "sigterm")
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bagpipe.embedding_server",
                "--shard",
                "0",
                "--table-rows",
                ",".join(["10"] * 26),
                "--redis",
                redis_server.url,
                "--job",
                "sigterm",
            ],
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )
        deadline = time.monotonic() + 60
        while "0" not in registry.members("embedding_server"):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert registry.members("embedding_server") == {}  # it left the job on its way out
    finally:
        redis_server.stop()


# ---- bad flags and files stop `bagpipe run` before anything starts


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--trainers", "0"], "--trainers: must be >= 1, got 0"),
        (["--iterations", "0"], "--iterations: synthetic data is endless; give a number of iterations"),
        (["--embedding-servers", "0"], "--embedding-servers: must be >= 1, got 0"),
        (["--hot-fraction", "0.1"], "--hot-fraction/--hot-share: set both or neither"),
        (["--device", "tpu"], "--device: invalid choice: 'tpu'"),
        *(
            [(["--device", "cuda"], "--device: cuda, but torch sees no CUDA device here")]
            if not torch.cuda.is_available()
            else []
        ),
        (["--lr", "-1"], "--lr: must be a finite number > 0, got -1.0"),
        (
            ["--embedding-dim", "8", "--bottom-mlp", "64,16"],
            "--bottom-mlp: the last size (16) must equal embedding_dim (8)",
        ),
        (
            ["--model", "wdl", "--top-mlp", "8,1"],
            "--top-mlp: belongs to --model dlrm; wdl takes --deep-mlp",
        ),
        (["--momentum", "0.9"], "--momentum: 0.9 is not supported"),
        (["--optimizer", "adam", "--weight-decay", "0.01"], "--weight-decay: 0.01 is not supported"),
        (["--data", "criteo:/no/such.tsv"], "--data: /no/such.tsv: no such file"),
        (["--batch-size", "7"], "--batch-size: must be a positive multiple of trainers (2), got 7"),
        (
            ["--data", "hdfs:x"],
            "--data: expected 'synthetic', 'criteo:PATH', 'avazu:PATH', 'csv:PATH', 'tsv:PATH' or "
            "'parquet:PATH', got 'hdfs:x'",
        ),
    ],
)
def test_bad_flags_stop_bagpipe_run_with_one_line(
    flags: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The command as a user runs it: a flag that does not parse ends with argparse's usage and one line
    naming it; a value a rule refuses, or an input that is missing, with one line ``bagpipe run: FLAG:
    WHY``. Nothing starts and nothing is written."""
    with pytest.raises(SystemExit) as err:
        cli.main(["run", *flags, "--run-dir", str(tmp_path / "r"), "--quiet"])
    said = str(err.value.code) if isinstance(err.value.code, str) else capsys.readouterr().err.strip()
    last = said.splitlines()[-1]
    assert err.value.code != 0 and message in last, said
    assert last.startswith("bagpipe run: ") and (isinstance(err.value.code, int) or "\n" not in said)
    assert not (tmp_path / "r").exists()


def test_an_empty_input_file_is_named(tmp_path: Path) -> None:
    empty = tmp_path / "empty.tsv"
    empty.write_text("")
    with pytest.raises(SystemExit, match=f"--data: {empty}: empty file"):
        check_inputs(cli.parse_run(["--data", f"criteo:{empty}"]))
    with pytest.raises(ValueError, match=f"{empty}:0: field file: '' is empty"):
        list(CriteoTSVSource(CriteoConfig(paths=(str(empty),), table_rows=tuple([10] * 26))).batches(1))


def test_a_dense_value_too_large_names_file_line_and_field(tmp_path: Path) -> None:
    good = "1\t" + "\t".join(["3"] * 13) + "\t" + "\t".join(["a1b2"] * 26) + "\n"
    bad = "0\t" + "\t".join(["1" + "0" * 400] + ["3"] * 12) + "\t" + "\t".join(["a1b2"] * 26) + "\n"
    path = tmp_path / "big.tsv"
    path.write_text(good + bad)
    with pytest.raises(
        ValueError, match=rf"{path}:2: field I1: '1000.*' is out of range \(more than 18 digits\)"
    ):
        list(CriteoTSVSource(CriteoConfig(paths=(str(path),), table_rows=tuple([10] * 26))).batches(1))


# ---- fuzz: bad data files end with the line named, or with exactly the good rows

FUZZ_LINE_LIMIT = 600  # (MAX_LINE_BYTES for the fuzz: an oversize field costs a few hundred bytes)
CRITEO_ROWS = tuple(range(3, 29))


def _criteo_fields(rng: random.Random) -> list[str]:
    dense = [rng.choice(["", "0", "-1", str(rng.randrange(10**6))]) for _ in range(13)]
    cats = [rng.choice(["", f"{rng.getrandbits(32):x}", f"{rng.getrandbits(64):X}"]) for _ in range(26)]
    return [rng.choice("01"), *dense, *cats]


def _avazu_fields(rng: random.Random) -> list[str]:
    hour = f"1410{rng.randrange(21, 31)}{rng.randrange(24):02d}"
    cats = [rng.choice(["", "a99f214a", "-1", "1fbe01fe"]) for _ in range(21)]
    if rng.random() < 0.5:  # a long field, within the line limit
        cats[rng.randrange(21)] = "x" * rng.randrange(1, FUZZ_LINE_LIMIT - 300)
    return [str(rng.getrandbits(60)), rng.choice("01"), hour, *cats]


def _bad_criteo(rng: random.Random, fields: list[str]) -> str:
    """Puts one value out of the contract into ``fields``; returns the field the error must name."""
    kind = rng.randrange(6)
    if kind == 0:  # a dense value that is not finite, or no integer
        k = rng.randrange(1, 14)
        fields[k] = rng.choice(["nan", "NaN", "inf", "-inf", "Infinity", "1e999", "1.5", "1" + "0" * 30])
        return f"I{k}"
    if kind == 1:
        fields[0] = rng.choice(["2", "-1", "", "0.5", "nan", "11"])
        return "label"
    if kind == 2:  # an index beyond 128 bits, negative or not hexadecimal
        k = rng.randrange(1, 27)
        fields[13 + k] = rng.choice(["f" * 33, "-1", "-a1", "zz", "0x1f"])
        return f"C{k}"
    if kind == 3:  # an oversize field
        fields[rng.randrange(len(fields))] = "a" * rng.randrange(FUZZ_LINE_LIMIT, 3 * FUZZ_LINE_LIMIT)
        return "line"
    if kind == 4:
        del fields[rng.randrange(len(fields))]
    else:
        fields.insert(rng.randrange(len(fields)), "1")
    return "fields"


def _bad_avazu(rng: random.Random, fields: list[str]) -> str:
    kind = rng.randrange(4)
    if kind == 0:
        fields[1] = rng.choice(["2", "-1", "", "nan", "01"])
        return "click"
    if kind == 1:
        fields[2] = rng.choice(["nan", "inf", "14102124", "1410210", "-4102100", "141021xx"])
        return "hour"
    if kind == 2:
        fields[rng.randrange(3, 24)] = "b" * rng.randrange(FUZZ_LINE_LIMIT, 3 * FUZZ_LINE_LIMIT)
        return "line"
    del fields[rng.randrange(len(fields))]
    return "fields"


def _joined(samples: list) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    if not samples:
        return np.zeros((0,)), np.zeros((0,)), np.zeros((0,))
    return tuple(
        np.concatenate([getattr(s, name) for s in samples]) for name in ("dense", "sparse", "labels")
    )


def test_a_seeded_fuzz_of_bad_data_files_names_the_line_or_keeps_exactly_the_good_rows(
    tmp_path: Path, monkeypatch
) -> None:
    """Files with values out of the contract (dense values that are not finite, labels out of {0, 1},
    indices out of range, oversize fields, wrong column counts) among good lines, read a chunk of a few
    hundred bytes at a time: without --skip-bad-rows the error names the file, the first bad line and its
    column; with it the batches are exactly those of the good lines alone, and the bad ones are counted.
    Avazu's categorical rows are checked against FNV-1a computed one value at a time."""
    from bagpipe.core.data import DataFormatError
    from bagpipe.data_processor import files

    monkeypatch.setattr(files, "MAX_LINE_BYTES", FUZZ_LINE_LIMIT)
    rng = random.Random(53)
    fields_seen: set[str] = set()
    for i in range(80):
        monkeypatch.setattr(files, "CHUNK_BYTES", rng.randrange(200, 4000))
        avazu = i % 2 == 1
        make, spoil, sep = (_avazu_fields, _bad_avazu, ",") if avazu else (_criteo_fields, _bad_criteo, "\t")
        header = [files.AVAZU_HEADER.decode()] if avazu and rng.random() < 0.5 else []
        good, lines, first_bad = [], list(header), None
        for _ in range(rng.randrange(3, 25)):
            fields = make(rng)
            if rng.random() < 0.2:
                field = spoil(rng, fields)
                if first_bad is None:
                    first_bad = (len(lines) + 1, field)
            else:
                good.append(sep.join(fields))
            lines.append(sep.join(fields))
        if first_bad is None:  # at least one bad line
            fields = make(rng)
            first_bad = (len(lines) + 1, spoil(rng, fields))
            lines.append(sep.join(fields))
        path, clean = tmp_path / f"bad-{i}", tmp_path / f"clean-{i}"
        path.write_text("\n".join(lines) + ("\n" if rng.random() < 0.5 else ""))
        clean.write_text("\n".join(header + good) + "\n")
        if avazu:
            source: type[files.FileSource] = files.AvazuCSVSource
            config: type[files.FileConfig] = files.AvazuConfig
            rows = files.AVAZU_TABLE_ROWS
        else:
            source, config, rows = files.CriteoTSVSource, files.CriteoConfig, CRITEO_ROWS

        with pytest.raises(DataFormatError) as err:
            list(source(config(paths=(str(path),), table_rows=rows)).batches(1))
        assert (err.value.path, err.value.line, err.value.field) == (str(path), *first_bad), (
            i,
            str(err.value),
        )
        assert str(err.value).startswith(f"{path}:{first_bad[0]}: field {first_bad[1]}: ")
        fields_seen.add(first_bad[1])

        batch = rng.randrange(1, 4)
        skipping = source(config(paths=(str(path),), table_rows=rows, skip_bad_rows=True))
        got = [s for _, s in skipping.batches(batch)]
        assert skipping.bad_rows == len(lines) - len(header) - len(good), i
        if len(good) < batch:
            assert not got
            continue
        want = [s for _, s in source(config(paths=(str(clean),), table_rows=rows)).batches(batch)]
        for a, b in zip(_joined(got), _joined(want), strict=True):
            assert np.array_equal(a, b), i
        if avazu:
            sparse = _joined(got)[1]
            for n, line in enumerate(good[: sparse.shape[0]]):
                values = line.split(",")[2:]
                expect = [files.fnv1a64(v.encode()) % r for v, r in zip(values, rows, strict=True)]
                assert sparse[n].tolist() == expect, (i, n)
    assert fields_seen >= {"label", "click", "hour", "line", "fields"}
    assert any(f.startswith("I") for f in fields_seen) and any(f.startswith("C") for f in fields_seen)


async def _stream_bad_file(path: Path, skip: bool) -> tuple[grpc.StatusCode, str, list[int]]:
    source = SourceConfig(f"criteo:{path}", CRITEO_ROWS, skip_bad_rows=skip)
    server, port, _, _ = await create_data_processor(DataProcessorConfig(source, 2, 0))
    numbers: list[int] = []
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = data_processor_pb2_grpc.DataProcessorStub(ch)
            request = data_processor_pb2.StreamBatchesRequest(start=0, stride=1)
            try:
                async for part in stub.StreamBatches(request, timeout=30):
                    numbers.append(part.batch.number)
            except grpc.aio.AioRpcError as e:
                return e.code(), e.details() or "", numbers
    finally:
        await server.stop(None)
    return grpc.StatusCode.OK, "", numbers


def test_a_data_processor_names_a_non_finite_value_or_skips_its_line(tmp_path: Path) -> None:
    good = "\t".join(["1", *["3"] * 13, *["a1b2"] * 26])
    bad = "\t".join(["0", *["3"] * 5, "inf", *["3"] * 7, *["a1b2"] * 26])
    path = tmp_path / "inf.tsv"
    path.write_text("\n".join([good, good, good, bad, good, good]) + "\n")
    code, details, _ = asyncio.run(_stream_bad_file(path, skip=False))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details == f"data: {path}:4: field I6: 'inf' is not finite (an integer is expected)"
    assert asyncio.run(_stream_bad_file(path, skip=True))[::2] == (grpc.StatusCode.OK, [0, 1])


# ---- mutual TLS


def _use_tls(monkeypatch, files: dict[str, str]) -> None:
    for kind, path in files.items():
        monkeypatch.setenv(tls.TLS_ENV[kind], path)


async def _tls_server(store: ShardStore, files: dict[str, str], stranger: dict[str, str]) -> None:
    server, port, _, _ = await create_embedding_server(store)
    try:
        address = f"127.0.0.1:{port}"
        request = epb.LookupRequest(shard_map_version=1, keys=to_tensor(np.array([1, 2], dtype=np.int64)))
        async with serving.aio_channel(address) as ch:  # the job's certificate: served
            await epb_grpc.EmbeddingServerStub(ch).Lookup(request, timeout=5)
        async with grpc.aio.insecure_channel(address) as ch:  # plaintext: no handshake
            assert await _code(lambda c=ch: epb_grpc.EmbeddingServerStub(c).Lookup(request, timeout=5)) == (
                grpc.StatusCode.UNAVAILABLE
            )
        pem = {k: Path(v).read_bytes() for k, v in stranger.items()}
        foreign = grpc.ssl_channel_credentials(pem["ca"], pem["key"], pem["cert"])  # another CA's certificate
        options = [("grpc.ssl_target_name_override", "bagpipe")]
        async with grpc.aio.secure_channel(address, foreign, options=options) as ch:
            assert await _code(lambda c=ch: epb_grpc.EmbeddingServerStub(c).Lookup(request, timeout=5)) == (
                grpc.StatusCode.UNAVAILABLE
            )
    finally:  # (a server left running is collected later, and its shutdown then hangs)
        await server.stop(None)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl binary to make certificates")
def test_mutual_tls_serves_only_the_jobscertificates(tmp_path: Path, monkeypatch) -> None:
    files = certificates(tmp_path / "job", "bagpipe")
    stranger = certificates(tmp_path / "other", "bagpipe")
    _use_tls(monkeypatch, files)
    asyncio.run(_tls_server(_store(), files, stranger))


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl binary to make certificates")
def test_a_whole_run_over_mutual_tls_matches_the_plaintext_one(run_job, tmp_path: Path, monkeypatch) -> None:
    from bagpipe.core import checkpoint

    from tests.integration.test_equivalence import assert_same_model

    flags = ("--iterations", "12", "--checkpoint-every", "4", "--optimizer", "adagrad", "--lr", "0.05")
    _, plain = run_job("plain", *flags)
    _use_tls(monkeypatch, certificates(tmp_path / "certs", "bagpipe"))
    _, tls = run_job("tls", *flags)
    assert_same_model(tls["final"], checkpoint.load(plain["final"]), tolerance=0.0)


def test_a_lost_redis_is_named_in_one_line_not_a_traceback(tmp_path: Path) -> None:
    redis_server = RedisServer(tmp_path)
    registry = Registry(redis_server.url, "lost")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "bagpipe.embedding_server",
            "--shard",
            "1",
            "--table-rows",
            ",".join(["10"] * 26),
            "--redis",
            redis_server.url,
            "--job",
            "lost",
            "--log-level",
            "WARNING",
        ],
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while "1" not in registry.members("embedding_server"):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        redis_server.stop()
    proc.send_signal(signal.SIGTERM)  # on its way out it cannot leave the job: Redis is gone
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert "Redis does not answer" in err and "Traceback" not in err, err


@pytest.mark.parametrize(
    ("module", "flags"),
    [
        ("bagpipe.controller", ["--trainers", "2"]),
        ("bagpipe.trainer", ["--rank", "0", "--world-size", "1", "--dist-init", "tcp://127.0.0.1:1"]),
        (
            "bagpipe.oracle_cacher",
            ["--table-rows", ",".join(["10"] * 26), "--trainers", "1", "--batch-size", "8"],
        ),
        ("bagpipe.embedding_server", ["--shard", "0", "--table-rows", ",".join(["10"] * 26)]),
    ],
)
def test_a_redis_that_cannot_be_resolved_at_start_is_one_line(module: str, flags: list[str]) -> None:
    """In a cluster Redis's name may not resolve yet when a pod starts: the service exits 1 with one line
    naming Redis, and the restart policy tries again; no traceback."""
    done = subprocess.run(
        [sys.executable, "-m", module, *flags, "--redis", "redis://no-such-host.invalid:6379/0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stderr
    assert "Redis does not answer" in done.stderr and "Traceback" not in done.stderr, done.stderr
