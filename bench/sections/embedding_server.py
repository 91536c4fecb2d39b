"""Section ``embedding_server``: one embedding server with every Kaggle row, started on its own with
nothing else running: lookups per second at 16 k keys per call through the trainers' own client, and
its resident memory against its rows and optimizer state (``bench/embedding_server.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from suite.common import in_own_process, log
from suite.report import Target


def server_measure(scale: float, keys: int, concurrency: int, seconds: float) -> dict[str, Any]:
    """``bench/embedding_server.py``, its client in a process of its own, as a trainer's is: in this
    one, after the other sections, the same lookups measured 11% fewer rows per second (4.88 against
    5.48-5.50 M on 2026-11-25)."""
    return in_own_process(
        "embedding_server.py", scale=scale, keys=keys, concurrency=concurrency, seconds=seconds
    )


def run(profile: dict[str, Any], out: Path) -> dict[str, Any]:
    """The server's lookups and memory at the profile's scale, keys per lookup, concurrency and time."""
    e = profile["embedding_server"]
    r = server_measure(e["scale"], e["keys"], e["concurrency"], e["seconds"])
    log(
        f"embedding server ({r['rows']:,} rows): {r['rows_per_second'] / 1e6:.2f} M rows/s at "
        f"{r['keys_per_call']:,} keys per lookup, target 5.00 M: ratio {r['ratio_to_target']:.2f} "
        f"({'met' if r['ratio_to_target'] >= 1 else 'NOT met'}); memory {r['memory_ratio']:.3f}x the rows "
        f"and state, target <= 1.1x ({'met' if r['memory_ratio'] <= 1.1 else 'NOT met'})"
    )
    return r


def targets(results: dict[str, Any]) -> tuple[list[Target], list[str]]:
    """Rows per second, and memory over the rows and their state."""
    server = results.get("embedding_server", {})
    if "rows_per_second" not in server:
        return [], []
    r = server["rows_per_second"] / 1e6
    memory = server["memory_ratio"]
    return [
        ("embedding server lookups, M rows/s", r, ">= 5.0", r >= 5.0),
        ("embedding server memory / rows+state", memory, "<= 1.1", memory <= 1.1),
    ], []
