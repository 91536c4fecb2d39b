"""One ``bagpipe run`` job of a profile's model and data, and its figures from the trainers' logs."""

from __future__ import annotations

import csv
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from bagpipe.cli import parse_run
from bagpipe.local.launcher import run as run_job

from suite.common import log


def job_argv(
    name: str, profile: dict[str, Any], out: Path, *extra: str, iterations: int | None = None
) -> list[str]:
    """``bagpipe run``'s arguments for a job of the profile's model and data, in ``out/runs/name``."""
    run_dir = out / "runs" / name
    shutil.rmtree(run_dir, ignore_errors=True)
    n = iterations or profile["iterations"]
    return [
        "run",
        "--quiet",
        "--no-report",  # (the harness reads the per-iteration logs and the summary)
        "--log-level",
        "WARNING",
        "--scale",
        profile["scale"],
        "--batch-size",
        str(profile["batch"]),
        "--iterations",
        str(n),
        "--trainers",
        "2",
        "--embedding-servers",
        "2",
        *profile["model"],
        *profile["optimizer"],
        "--run-dir",
        str(run_dir),
        # no consistent checkpoints unless a job asks: the ideal system cannot take them, so comparing
        # caching and traffic is fair only without them; section systems measures their cost apart
        "--checkpoint-every",
        "0",
        "--device",
        profile.get("device", "auto"),
        *extra,
    ]


def job(
    name: str, profile: dict[str, Any], out: Path, *extra: str, iterations: int | None = None
) -> dict[str, Any]:
    """Runs ``bagpipe run`` with the profile's model and data; returns timings and the breakdown."""
    n = iterations or profile["iterations"]
    argv = job_argv(name, profile, out, *extra, iterations=n)
    t0 = time.perf_counter()
    summary = run_job(parse_run(argv[1:]))
    run_dir = out / "runs" / name
    batches, per_iteration = iteration_times(run_dir)
    skip = max(5, len(per_iteration) // 10)
    result = job_result(name, list(extra), n, summary, batches[skip:], per_iteration[skip:])
    result["wall_s"] = time.perf_counter() - t0
    log(
        f"{name}: median {result['median_ms']:.1f} ms, p90 {result['p90_ms']:.1f} ms "
        f"({result['wall_s']:.0f} s)"
    )
    return result


def job_result(
    name: str,
    flags: list[str],
    iterations: int,
    summary: dict[str, Any],
    batches: list[int],
    seconds: list[float],
    stage_seconds: dict[str, float] | None = None,
) -> dict[str, Any]:
    """A job's figures: the timings of the measured iterations (``batches``, ``seconds``) and, from its
    summary, the rest; ``stage_seconds`` (per iteration) in place of the summary's where given."""
    stages = summary["stage_seconds_per_iteration"] if stage_seconds is None else stage_seconds
    return {
        "name": name,
        "flags": flags,
        "iterations": iterations,
        "iteration_ms": [1000 * t for t in seconds],
        "iteration_batch": batches,
        "median_ms": 1000 * statistics.median(seconds),
        "p90_ms": 1000 * sorted(seconds)[int(0.9 * (len(seconds) - 1))],
        "mean_ms": 1000 * statistics.fmean(seconds),
        "stage_ms": {k: 1000 * v for k, v in stages.items()},
        "cache_hit_rate": summary["cache_hit_rate"],
        "rows_per_iteration": summary["rows_per_iteration"],
        "rows_fetched_per_iteration": summary["rows_fetched_per_iteration"],
        "rows_fetched_initial_per_iteration": summary["rows_fetched_initial_per_iteration"],
        "rows_fetched_first_per_iteration": summary["rows_fetched_first_per_iteration"],
        "rows_synced_critical_per_iteration": summary["rows_synced_critical_per_iteration"],
        "cache_peak_occupancy_rows": summary["cache_peak_occupancy_rows"],
        "cache_capacity_rows": summary["cache_capacity_rows"],
        "lookahead": summary["lookahead"],
        "cpu_ms": {k: 1000 * v for k, v in summary.get("cpu_seconds_per_iteration", {}).items()},
    }


def trainer_rows(run_dir: Path) -> list[list[dict[str, str]]]:
    """Each trainer's per-iteration log, as far as it is written."""
    logs = []
    for path in sorted((run_dir / "metrics").glob("trainer-*.csv")):
        with open(path, newline="") as f:
            logs.append([r for r in csv.DictReader(f) if None not in r.values()])  # (not a line half written)
    return logs


def iteration_times(run_dir: Path) -> tuple[list[int], list[float]]:
    """Per iteration, its batch and the slowest trainer's time (training is synchronous)."""
    per_iteration = list(zip(*trainer_rows(run_dir), strict=True))
    return (
        [int(rows[0]["batch"]) for rows in per_iteration],
        [max(float(r["iteration_seconds"]) for r in rows) for rows in per_iteration],
    )
