"""``python -m bagpipe.probe``: waits until services are ready (the Helm chart's test, or a script's).

``--ready URL`` must answer 200 and ``--grpc-health HOST:PORT`` must report SERVING, within
``--timeout`` seconds; exits 1 naming what did not. With ``--redis`` and ``--job`` it reads the job's state
first: a failed job fails the probe with the controller's reason, and with ``--released-when-done`` a job
that is done passes without the checks (its serving tiers were scaled to zero once it finished).
"""

from __future__ import annotations

import argparse
import sys
import time
import urllib.error
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bagpipe import serving
from bagpipe.control.generation import DONE, FAILED, current
from bagpipe.control.registry import Registry


def http_ready(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return None if r.status == 200 else f"{url}: HTTP {r.status}"
    except urllib.error.HTTPError as e:
        return f"{url}: HTTP {e.code}"
    except OSError as e:
        return f"{url}: {e}"


def grpc_serving(address: str) -> str | None:
    try:
        with serving.channel(address) as ch:  # (TLS when the job uses it)
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    except grpc.RpcError as e:
        return f"{address}: {e.code().name}"
    return None if reply.status == health_pb2.HealthCheckResponse.SERVING else f"{address}: {reply.status}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bagpipe-probe", description=__doc__)
    p.add_argument(
        "--ready", action="append", default=[], metavar="URL", help="an HTTP URL that must answer 200"
    )
    p.add_argument("--grpc-health", action="append", default=[], metavar="HOST:PORT", help="must be SERVING")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to keep trying (default 120)")
    p.add_argument("--redis", metavar="URL", help="the job's Redis: read its state first")
    p.add_argument("--job", help="the job's name in Redis (with --redis)")
    p.add_argument(
        "--released-when-done",
        action="store_true",
        help="a job that is done passes without the checks (its serving tiers were scaled to zero)",
    )
    a = p.parse_args(argv)
    if bool(a.redis) != bool(a.job):
        p.error("--redis and --job go together")
    deadline = time.monotonic() + a.timeout
    if a.redis:
        generation = current(Registry(a.redis, a.job))
        if generation is not None and generation.state == FAILED:
            print(f"the job failed: {generation.reason}", file=sys.stderr)
            return 1
        if generation is not None and generation.state == DONE and a.released_when_done:
            print(f"the job is done (generation {generation.number}); its serving tiers were released")
            return 0
    while True:
        problems = [x for x in map(http_ready, a.ready) if x] + [
            x for x in map(grpc_serving, a.grpc_health) if x
        ]
        if not problems:
            print(f"ready: {len(a.ready) + len(a.grpc_health)} checks passed")
            return 0
        if time.monotonic() > deadline:
            print("not ready:\n  " + "\n  ".join(problems), file=sys.stderr)
            return 1
        time.sleep(2)


if __name__ == "__main__":
    sys.exit(main())
