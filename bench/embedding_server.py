"""One embedding server under lookups: rows/s at 16 k keys per call, and its memory against the raw rows.

A real ``bagpipe.embedding_server`` process (with a real Redis) holds the Kaggle tables scaled by
``--scale`` (dim 16, Adagrad state: the rows plus as many floats of state). Clients in this process
send lookups of ``--keys`` distinct random keys each through the trainers' own ``EmbeddingClient``,
``--concurrency`` at a time, for ``--seconds``: one thread keeps them in flight with ``lookup_async``
and reads each reply into place as it comes (``--threads``: a thread per lookup in flight, each
blocking in ``lookup``, which costs the shared cores more CPU per lookup); the figure is
the rows returned per second of wall time, measured from outside, so the client's own cost on a shared
machine counts against it. Memory is the server's resident set (``VmRSS``) over the bytes of its rows
and optimizer state (issue 17: at most 1.1x), after the lookups.

    .venv/bin/python bench/embedding_server.py [--scale 1.0 --keys 16384 --concurrency 4 --seconds 20]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
from bagpipe import allocator  # noqa: E402
from bagpipe.config_args import Coordination  # noqa: E402
from bagpipe.control.registry import Registry  # noqa: E402
from bagpipe.core.data import scaled_table_rows  # noqa: E402
from bagpipe.core.optim import OptimizerConfig  # noqa: E402
from bagpipe.embedding_server import config as server_config  # noqa: E402
from bagpipe.embedding_server.client import EmbeddingClient  # noqa: E402
from bagpipe.local.launcher import job_credentials  # noqa: E402
from bagpipe.local.redis_server import RedisServer  # noqa: E402

TARGET_ROWS_PER_SECOND = 5e6
TARGET_MEMORY_RATIO = 1.1


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def measure(
    scale: float, keys: int, concurrency: int, seconds: float, dim: int = 16, threads: bool = False
) -> dict[str, Any]:
    allocator.keep_freed_buffers()  # as in a trainer, the client here
    table_rows = tuple(scaled_table_rows(scale)) if scale < 1 else None
    with tempfile.TemporaryDirectory() as tmp, job_credentials():
        redis = RedisServer(Path(tmp))
        job = "bench-embedding-server"
        optimizer = OptimizerConfig("adagrad", 0.1)
        cfg = server_config.EmbeddingServerConfig(
            shard=0,
            initial_shards=1,
            table_rows=table_rows or tuple(scaled_table_rows(1.0)),
            embedding_dim=dim,
            optimizer=optimizer,
            seed=0,
            init_from=None,
            address="127.0.0.1:0",
            coordination=Coordination(redis.url, job, "WARNING"),
        )
        log = open(Path(tmp) / "server.log", "wb")  # noqa: SIM115
        server = subprocess.Popen(
            [sys.executable, "-m", "bagpipe.embedding_server", *server_config.argv(cfg)],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        registry = Registry(redis.url, job)
        try:
            started = time.perf_counter()
            registry.wait_for_members("embedding_server", 1, timeout=1800)
            init_seconds = time.perf_counter() - started
            shard_map, addresses = registry.embedding_servers()
            assert shard_map is not None
            state_width = optimizer.state_width(dim)
            client = EmbeddingClient(shard_map, addresses, dim, state_width)
            num_keys = shard_map.num_keys
            rng = np.random.default_rng(0)
            pool = [np.sort(rng.choice(num_keys, size=keys, replace=False)) for _ in range(64)]
            client.lookup(pool[0])  # (connection set up)
            done = [0] * concurrency
            stop = time.perf_counter() + seconds

            def worker(i: int) -> None:  # (--threads: one blocking lookup at a time on each thread)
                n = i
                while time.perf_counter() < stop:
                    rows, _ = client.lookup(pool[n % len(pool)])
                    done[i] += rows.shape[0]
                    n += concurrency

            t0 = time.perf_counter()
            if threads:
                workers = [threading.Thread(target=worker, args=(i,)) for i in range(concurrency)]
                for t in workers:
                    t.start()
                for t in workers:
                    t.join()
            else:  # one thread keeps ``concurrency`` lookups in flight, the oldest read first
                in_flight = deque(client.lookup_async(pool[n % len(pool)]) for n in range(concurrency))
                n = concurrency
                while in_flight:
                    rows, _ = in_flight.popleft().result()
                    done[0] += rows.shape[0]
                    if time.perf_counter() < stop:
                        in_flight.append(client.lookup_async(pool[n % len(pool)]))
                        n += 1
            wall = time.perf_counter() - t0
            # the answer is right, not only fast: one lookup against a second one of the same keys
            a, _ = client.lookup(pool[1])
            b, _ = client.lookup(pool[1])
            assert np.array_equal(a, b) and a.shape == (keys, dim)
            rss = rss_bytes(server.pid)
            raw = num_keys * (dim + state_width) * 4
            client.close()
        finally:
            server.terminate()
            server.wait(30)
            log.close()
            registry.close()
            redis.stop()
    rows_per_second = sum(done) / wall
    return {
        "benchmark": "embedding_server",
        "rows": num_keys,
        "dim": dim,
        "state_width": state_width,
        "keys_per_call": keys,
        "concurrency": concurrency,
        "client": "threads" if threads else "async",
        "seconds": wall,
        "lookups": sum(done) // keys,
        "rows_per_second": rows_per_second,
        "target_rows_per_second": TARGET_ROWS_PER_SECOND,
        "ratio_to_target": rows_per_second / TARGET_ROWS_PER_SECOND,
        "server_rss_bytes": rss,
        "raw_bytes": raw,
        "memory_ratio": rss / raw,
        "target_memory_ratio": TARGET_MEMORY_RATIO,
        "server_start_seconds": init_seconds,
        "cpus": os.cpu_count(),
        "machine": platform.processor() or platform.machine(),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--scale", type=float, default=1.0, help="Kaggle cardinalities times this (1: 33.8 M rows)"
    )
    p.add_argument("--keys", type=int, default=16384, help="distinct keys per lookup")
    p.add_argument("--concurrency", type=int, default=4, help="lookups in flight")
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument(
        "--threads",
        action="store_true",
        help="a thread per lookup in flight, each blocking in `lookup` (default: one thread keeps them in "
        "flight with `lookup_async`)",
    )
    p.add_argument("--out", default="bench/results/embedding_server.json")
    a = p.parse_args()
    r = measure(a.scale, a.keys, a.concurrency, a.seconds, threads=a.threads)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(r, indent=2))
    print(
        f"embedding server: {r['rows']:,} rows (dim {r['dim']}, Adagrad), {r['keys_per_call']:,} keys per "
        f"lookup, {r['concurrency']} in flight ({r['client']}): {r['rows_per_second'] / 1e6:.2f} M rows/s, "
        "target 5.00 M -> "
        f"ratio {r['ratio_to_target']:.2f}; memory {r['server_rss_bytes'] / 2**30:.2f} GiB for "
        f"{r['raw_bytes'] / 2**30:.2f} GiB of rows and state -> {r['memory_ratio']:.3f}x (target <= 1.1x)"
    )


if __name__ == "__main__":
    main()
