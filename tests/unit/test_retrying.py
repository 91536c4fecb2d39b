"""``serving.retrying``: gRPC itself retries a call the server answered UNAVAILABLE (a restarting server),
with the project's one retry rule, and gives up after ``rpc.RETRIES`` attempts."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest
from bagpipe import rpc, serving
from bagpipe.v1 import oracle_cacher_pb2 as opb
from bagpipe.v1 import oracle_cacher_pb2_grpc as opb_grpc


class _Flaky(opb_grpc.OracleCacherServicer):
    """Answers UNAVAILABLE ``failures`` times, then acknowledges."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls = 0

    def ReportProgress(self, request, context):  # noqa: N802
        self.calls += 1
        if self.calls <= self.failures:
            context.abort(grpc.StatusCode.UNAVAILABLE, "restarting")
        return opb.ProgressAck()


@pytest.mark.parametrize("failures", [2, rpc.RETRIES])
def test_unavailable_is_retried_by_grpc_up_to_the_limit(failures: int) -> None:
    servicer = _Flaky(failures)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    opb_grpc.add_OracleCacherServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with serving.channel(f"127.0.0.1:{port}", serving.retrying("OracleCacher", "ReportProgress")) as ch:
            report = opb_grpc.OracleCacherStub(ch).ReportProgress
            if failures < rpc.RETRIES:
                report(opb.ProgressReport(rank=0, trained=1, written_back=1), timeout=10)
                assert servicer.calls == failures + 1
            else:
                with pytest.raises(grpc.RpcError) as err:
                    report(opb.ProgressReport(rank=0, trained=1, written_back=1), timeout=10)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
                assert servicer.calls == rpc.RETRIES
    finally:
        server.stop(None)
