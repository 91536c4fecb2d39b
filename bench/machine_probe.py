"""How fast this machine is right now, on three fixed workloads, to read the bench's absolute figures by.

The bench's machines are shared, and their speed moves by the hour: on 2026-11-25 the same code planned
a batch in 2.66 ms at 16:37 and in 3.68 ms at 19:55, and TorchRec's compute reference took 22.1 and
45.5 ms. The harness runs this probe before and after its sections, so that a run's figures can be set
against the machine's speed at the time, and two runs against each other. All three workloads run on
one core, and none uses any Bagpipe code:

* ``compute_ms``: 40 products of two 512 x 512 float32 matrices (BLAS, one thread), like a trainer's MLPs;
* ``random_read_ms``: 2 M reads of 8 bytes at random positions of a 512 MB array, in sorted order, like
  the oracle's per-key records and an embedding server's rows;
* ``python_ms``: a loop of 2 M steps in the interpreter, like the services' control paths.

Each is the best of five repetitions, so that a second's hiccup does not set it.

    .venv/bin/python bench/machine_probe.py [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

RANDOM_ARRAY_BYTES = 512 << 20
RANDOM_READS = 2_000_000


def _best_ms(work: Callable[[], Any], repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - start)
    return 1000 * best


def _interpreter(steps: int) -> int:
    total = 0
    for i in range(steps):
        total += i & 7
    return total


def probe() -> dict[str, float]:
    """The three workloads' times in ms (the best of five each)."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((512, 512), dtype=np.float32)
    b = rng.standard_normal((512, 512), dtype=np.float32)

    def products() -> None:
        for _ in range(40):
            np.matmul(a, b)

    table = np.ones(RANDOM_ARRAY_BYTES // 8, dtype=np.int64)  # (every page touched before timing)
    index = np.sort(rng.integers(0, table.size, RANDOM_READS))
    return {
        "compute_ms": _best_ms(products),
        "random_read_ms": _best_ms(lambda: table.take(index)),
        "python_ms": _best_ms(lambda: _interpreter(2_000_000)),
    }


def describe(figures: dict[str, float]) -> str:
    return (
        f"compute {figures['compute_ms']:.1f} ms, random reads {figures['random_read_ms']:.1f} ms, "
        f"interpreter {figures['python_ms']:.1f} ms"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="also write the figures here, as JSON")
    figures = probe()
    out = p.parse_args().out
    if out:
        Path(out).write_text(json.dumps(figures))
    print(f"machine probe: {describe(figures)}")


if __name__ == "__main__":
    main()
