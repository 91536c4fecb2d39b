"""What strangers' open ``Health.Watch`` streams and idle connections cost one server's memory.

An embedding server (tiny tables, the job's secret set) runs in a process of its own. A stranger (no
secret) opens ``--watches`` watch streams over ``--connections`` connections and holds them open, each
watch sending a request of ``--request-bytes`` that the server never reads: what it buffers of one is the
stream's receive window (a larger request would leave the stranger's own send unfinished, so the default
is just under the 1 MiB window). That is done ``--rounds`` times, the last round's watches closed first;
then ``--idle`` more connections that make no call are opened. Prints the server's resident memory
(VmRSS) alone and, once it has settled, after each step; how many watches were answered and how many
refused (RESOURCE_EXHAUSTED: the server's cap); whether a health check still answers; and the server's
peak. Writes nothing.

    PYTHONPATH=services .venv/bin/python bench/health_watches.py [--watches 256] [--connections 32]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import grpc
from bagpipe import security
from grpc_health.v1 import health_pb2, health_pb2_grpc

MB = 1 << 20
SECRET = "health-watches-bench-secret"
STATUS = health_pb2.HealthCheckResponse.ServingStatus
SERVER = textwrap.dedent(
    """
    import asyncio
    from bagpipe.core.data import table_offsets
    from bagpipe.core.shard_map import ShardMap
    from bagpipe.embedding_server.shard_store import ShardStore
    from bagpipe.embedding_server.server import create_server

    async def main():
        store = ShardStore(ShardMap.create(80, 1, num_buckets=8), 0, table_offsets([50, 30]), 4, 4, seed=1)
        server, port, _, _ = await create_server(store)
        print(port, flush=True)
        await server.wait_for_termination()

    asyncio.run(main())
    """
)


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS in /proc/{pid}/status")


async def settled(pid: int) -> int:
    """The server's resident memory once it has stopped changing by more than 1 MB for a second."""
    last = rss(pid)
    for _ in range(60):
        await asyncio.sleep(1.0)
        now = rss(pid)
        if abs(now - last) < MB:
            return now
        last = now
    return last


def stranger_channel(address: str, request_bytes: int) -> grpc.aio.Channel:
    # a channel of its own (no shared subchannel): one connection each
    options = [("grpc.use_local_subchannel_pool", 1), ("grpc.max_send_message_length", request_bytes + MB)]
    return grpc.aio.insecure_channel(address, options=options)


async def open_watch(ch: grpc.aio.Channel, payload: bytes) -> tuple[Any, str]:
    """One stranger's watch: its first answer's status name, or the code it was refused with."""
    watch = ch.unary_stream("/grpc.health.v1.Health/Watch")(payload)
    try:
        reply = await asyncio.wait_for(watch.read(), 30)
    except grpc.aio.AioRpcError as e:
        return watch, e.code().name
    if reply is grpc.aio.EOF:
        return watch, "EOF"
    return watch, STATUS.Name(health_pb2.HealthCheckResponse.FromString(reply).status)


async def main(a: argparse.Namespace) -> None:
    env = {**os.environ, security.JOB_SECRET_ENV: SECRET}
    proc = subprocess.Popen([sys.executable, "-c", SERVER], env=env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    address = f"127.0.0.1:{int(proc.stdout.readline())}"
    channels: list[grpc.aio.Channel] = []
    try:
        base = await settled(proc.pid)
        print(f"server alone: {base / MB:.0f} MB")
        payload = bytes(a.request_bytes)
        watched = base
        for round_ in range(a.rounds):
            for ch in channels:  # (the last round's watches end: their places are free again)
                await ch.close(None)
            channels = [stranger_channel(address, a.request_bytes) for _ in range(a.connections)]
            opened = await asyncio.gather(
                *(open_watch(channels[i % a.connections], payload) for i in range(a.watches))
            )
            outcomes: dict[str, int] = {}
            for _, outcome in opened:
                outcomes[outcome] = outcomes.get(outcome, 0) + 1
            watched = await settled(proc.pid)
            print(
                f"round {round_}: {a.watches} stranger watches over {a.connections} connections, "
                f"{a.request_bytes / MB:g} MB requests: {outcomes}; server {watched / MB:.0f} MB "
                f"(+{(watched - base) / MB:.0f} over the server alone)"
            )
        idle = [stranger_channel(address, 0) for _ in range(a.idle)]
        for ch in idle:
            await asyncio.wait_for(ch.channel_ready(), 30)
        channels += idle
        with_idle = await settled(proc.pid)
        grown = with_idle - watched
        print(
            f"+ {a.idle} idle connections: server {with_idle / MB:.0f} MB "
            f"(+{grown / MB:.0f}, {grown / max(a.idle, 1) / 1024:.0f} KB each)"
        )
        async with grpc.aio.insecure_channel(address) as ch:
            check = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
            print(f"a health check meanwhile: {STATUS.Name(check.status)}")
        open_now = sum(1 for w, o in opened if o == "SERVING" and not w.done())
        print(f"watches still open: {open_now}")
        print(f"server peak: {_peak(proc.pid) / MB:.0f} MB")
    finally:
        for ch in channels:
            await ch.close(None)
        proc.kill()
        proc.wait()


def _peak(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmHWM in /proc/{pid}/status")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--watches", type=int, default=256)
    p.add_argument("--connections", type=int, default=32)
    p.add_argument("--request-bytes", type=int, default=1_000_000)
    p.add_argument("--rounds", type=int, default=2, help="times the watches are closed and opened again")
    p.add_argument("--idle", type=int, default=1000, help="idle connections opened after the watches")
    started = time.monotonic()
    asyncio.run(main(p.parse_args()))
    print(f"({time.monotonic() - started:.0f} s)")
