"""``python -m bagpipe.probe``: waits until services are ready (the Helm chart's test, or a script's).

``--ready URL`` must answer 200 and ``--grpc-health HOST:PORT`` must report SERVING, within
``--timeout`` seconds; exits 1 naming what did not.
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
    a = p.parse_args(argv)
    deadline = time.monotonic() + a.timeout
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
