"""Hardening benchmark: a live ``bagpipe run`` attacked by a stranger, against the same run left alone.

The attacker knows the services' addresses but not the job's secret. Once the job trains, until it ends:
- every ``--every`` seconds, 16 concurrent 256 MB ``WriteBack`` calls without the secret to embedding
  server 0 (each should be refused UNAUTHENTICATED, its body unread);
- as many open ``Health.Watch`` streams as a server takes (``health_service.MAX_WATCHERS``) each to the data
  processor, the oracle and embedding server 0 (no secret is needed for health);
- 200 idle TCP connections to every service's ``/metrics`` port, while a scrape of ``/metrics`` and of
  ``/healthz`` is timed each second.

Runs alone and attacked go in turns (``--pairs``). Prints, per pair, the samples per second of both and
their ratio, the failures the attacked run recorded (there should be none), the slowest scrape, and the
attacked server's peak resident memory above its level when the attacks began. The attacker is a process
of its own at ``--nice`` (default 19): on two shared cores its own CPU (copying 4 GB of requests a round)
would otherwise be most of what the job loses; at 19 it runs on what the job leaves idle, so the job's
loss is what refusing costs the services. ``--nice 0`` measures both together. Writes
``bench/results/attacks-quick.json`` with the commit and the machine probe before and after.

    .venv/bin/python bench/attacks.py [--iterations 4000] [--pairs 2] [--nice 19]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import psutil
from bagpipe.cli import parse_run
from bagpipe.health_service import MAX_WATCHERS
from bagpipe.local.launcher import run
from bagpipe.local.record import run_record
from grpc_health.v1 import health_pb2, health_pb2_grpc
from machine_probe import probe

RESULTS = Path(__file__).parent / "results"
STOP = "attack.stop"  # (in the run's directory: the job is over, the attacker stops)
MB = 1 << 20
STRANGER_CALLS, STRANGER_BYTES = 16, 256 * MB
WATCHERS, IDLE_CONNECTIONS = MAX_WATCHERS, 200


def _trained(run_dir: Path) -> int:
    try:
        return len((run_dir / "metrics" / "trainer-0.csv").read_text().splitlines()) - 1
    except OSError:
        return 0


def _job_redis(run_dir: Path) -> tuple[Any, str]:
    """The job's Redis (its port from the Redis log, its password from the run's redis.conf) and the job's
    key prefix: where Prometheus, and an attacker who can read the cluster's service discovery, find the
    services."""
    import redis

    port = re.search(r"port=(\d+)", (run_dir / "redis.log").read_text())
    assert port is not None, f"{run_dir}/redis.log: no port"
    password = (run_dir / "redis.conf").read_text().split()[1]
    client = redis.Redis(port=int(port.group(1)), password=password, decode_responses=True)
    [key] = client.keys("bagpipe:*:metrics")
    return client, key.rsplit(":", 1)[0]


def _addresses(run_dir: Path) -> dict[str, str]:
    """Each service's gRPC address by its process name (``embedding-server-0``)."""
    client, prefix = _job_redis(run_dir)
    found = {}
    for service, name in (
        ("data_processor", "data-processor-{}"),
        ("oracle_cacher", "oracle-cacher"),
        ("embedding_server", "embedding-server-{}"),
    ):
        for member, address in client.hgetall(f"{prefix}:members:{service}").items():
            found[name.format(member)] = address
    return found


def _metrics_endpoints(run_dir: Path) -> list[str]:
    """Every member's /metrics address."""
    client, prefix = _job_redis(run_dir)
    return list(client.hgetall(f"{prefix}:metrics").values())


def _server_pid(name: str) -> int:
    for p in psutil.process_iter(["cmdline"]):
        if name in " ".join(p.info["cmdline"] or []):
            return p.pid
    raise RuntimeError(f"no process {name!r}")


async def _strangers(address: str) -> set[str]:
    payload = bytes(STRANGER_BYTES)  # (never parsed: a server that reads it before refusing pays for it)
    options = [("grpc.max_send_message_length", STRANGER_BYTES + MB)]
    async with grpc.aio.insecure_channel(address, options=options) as ch:
        write_back = ch.unary_unary("/bagpipe.v1.EmbeddingServer/WriteBack")

        async def one() -> str:
            try:
                await write_back(payload, timeout=60)
            except grpc.aio.AioRpcError as e:
                return e.code().name
            return "OK"

        return set(await asyncio.gather(*(one() for _ in range(STRANGER_CALLS))))


async def _attack(run_dir: Path, done: Callable[[], bool], every: float) -> dict[str, Any]:
    addresses = _addresses(run_dir)
    endpoints = _metrics_endpoints(run_dir)
    pid = _server_pid("bagpipe.embedding_server --shard 0")
    rss_before = psutil.Process(pid).memory_info().rss
    channels, watches = [], []
    for name in ("data-processor-0", "oracle-cacher", "embedding-server-0"):
        ch = grpc.aio.insecure_channel(addresses[name])
        channels.append(ch)
        calls = [
            health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest()) for _ in range(WATCHERS)
        ]
        for call in calls:
            await call.read()
        watches += calls
    idle = [
        socket.create_connection(tuple(e.rsplit(":", 1))) for e in endpoints for _ in range(IDLE_CONNECTIONS)
    ]
    codes: set[str] = set()
    slowest, rss_peak, rounds = 0.0, rss_before, 0
    next_strangers = 0.0
    while not done():
        for endpoint in endpoints:
            for path in ("/metrics", "/healthz"):
                t = time.perf_counter()
                try:
                    urllib.request.urlopen(f"http://{endpoint}{path}", timeout=5).read()
                except OSError:
                    continue  # (a member stopping at the job's end)
                slowest = max(slowest, time.perf_counter() - t)
        if time.monotonic() >= next_strangers:
            try:
                codes |= await _strangers(addresses["embedding-server-0"])
                rounds += 1
            except grpc.aio.AioRpcError:
                pass
            next_strangers = time.monotonic() + every
        try:
            rss_peak = max(rss_peak, psutil.Process(pid).memory_info().rss)
        except psutil.NoSuchProcess:
            break
        await asyncio.sleep(1.0)
    for s in idle:
        s.close()
    for ch in channels:
        await ch.close()
    return {
        "stranger_rounds": rounds,
        "stranger_codes": sorted(codes),
        "watchers": len(watches),
        "idle_metrics_connections": len(idle),
        "slowest_scrape_s": slowest,
        "server_rss_growth_mb": (rss_peak - rss_before) / MB,
        "attacker_cpu_seconds": sum(psutil.Process().cpu_times()[:2]),
    }


def one_run(iterations: int, run_dir: Path, attack: bool, every: float, nice: int) -> dict[str, Any]:
    argv = ["run", "--log-level", "WARNING", "--iterations", str(iterations), "--no-report", "--quiet"]
    out: list[dict[str, Any]] = []
    done = threading.Event()

    def job() -> None:
        try:
            out.append(run(parse_run([*argv[1:], "--run-dir", str(run_dir)])))
        finally:
            done.set()

    thread = threading.Thread(target=job)
    thread.start()
    attacked: dict[str, Any] = {}
    if attack:
        while _trained(run_dir) < iterations // 8 and not done.is_set():
            time.sleep(0.2)
        # the stranger is a process of its own, at the CPU priority given: what the job loses is then the
        # servers' cost of refusing, not the attacker's own CPU taken from two shared cores
        result = run_dir / "attack.json"
        attacker = subprocess.Popen(
            [
                "nice",
                "-n",
                str(nice),
                sys.executable,
                __file__,
                "--attack",
                str(run_dir),
                "--every",
                str(every),
            ]
        )
        done.wait()
        (run_dir / STOP).touch()
        attacker.wait(120)
        attacked = json.loads(result.read_text())
    thread.join()
    summary = out[0]
    return {
        "samples_per_second": summary["samples_per_second"],
        "failures": len(summary["recovery"]["failures"]),
        **attacked,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iterations", type=int, default=4000)
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--every", type=float, default=2.0, help="seconds between rounds of oversize strangers")
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/bagpipe-attacks"))
    p.add_argument("--nice", type=int, default=19, help="the attacker's CPU niceness (0: the job's own)")
    p.add_argument("--attack", type=Path, help=argparse.SUPPRESS)  # (the attacker process: a run's dir)
    a = p.parse_args()
    if a.attack is not None:
        stop = a.attack / STOP
        attacked = asyncio.run(_attack(a.attack, stop.exists, a.every))
        (a.attack / "attack.json").write_text(json.dumps(attacked))
        return
    pairs = []
    before = probe()
    for i in range(a.pairs):
        alone = one_run(a.iterations, a.work_dir / f"alone-{i}", False, a.every, a.nice)
        attacked = one_run(a.iterations, a.work_dir / f"attacked-{i}", True, a.every, a.nice)
        ratio = alone["samples_per_second"] / attacked["samples_per_second"]
        pairs.append({"alone": alone, "attacked": attacked, "alone_over_attacked": ratio})
        print(
            f"pair {i}: alone {alone['samples_per_second']:,.0f} samples/s, attacked "
            f"{attacked['samples_per_second']:,.0f} ({ratio:.3f}x); failures {attacked['failures']}; "
            f"strangers {attacked['stranger_rounds']} rounds -> {attacked['stranger_codes']}; slowest scrape "
            f"{attacked['slowest_scrape_s']:.3f} s with {attacked['idle_metrics_connections']} idle "
            "connections; "
            f"server RSS +{attacked['server_rss_growth_mb']:.0f} MB; the attacker used "
            f"{attacked['attacker_cpu_seconds']:.0f} CPU seconds at nice {a.nice}",
            flush=True,
        )
    RESULTS.mkdir(exist_ok=True)
    record = {
        **{k: v for k, v in run_record().items() if k in ("git_revision", "git_dirty", "host", "cpus")},
        "iterations": a.iterations,
        "every_s": a.every,
        "nice": a.nice,
        "time": time.time(),
        "machine_probe": {"before": before, "after": probe()},
        "pairs": pairs,
    }
    (RESULTS / "attacks-quick.json").write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
