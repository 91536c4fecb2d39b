"""The three systems side by side: bagpipe and the ideal in pairs run in turns, no-cache alone."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from suite.interleave import interleaved
from suite.jobs import job

SYSTEMS = {"ideal": ["--system", "ideal"], "bagpipe": [], "no-cache": ["--system", "no-cache"]}


def pooled(jobs: list[dict[str, Any]]) -> dict[str, Any]:
    """One system's repeats as one result: timings over every measured iteration of them all, and the
    other figures (CPU, stages, rows) averaged; ``repeat_medians_ms`` keeps each run's median."""
    if len(jobs) == 1:
        return jobs[0]
    times = [t for j in jobs for t in j["iteration_ms"]]

    def mean_of(key: str) -> dict[str, float]:
        return {k: statistics.fmean(j[key][k] for j in jobs) for k in jobs[0][key]}

    return {
        **jobs[0],
        "name": jobs[0]["name"].removesuffix("-1"),
        "iteration_ms": times,
        "iteration_batch": [b for j in jobs for b in j.get("iteration_batch", [])],
        "median_ms": statistics.median(times),
        "p90_ms": sorted(times)[int(0.9 * (len(times) - 1))],
        "mean_ms": statistics.fmean(times),
        "stage_ms": mean_of("stage_ms"),
        "cpu_ms": mean_of("cpu_ms"),
        "wall_s": sum(j["wall_s"] for j in jobs),
        "repeat_medians_ms": [j["median_ms"] for j in jobs],
    }


def compare(
    label: str,
    profile: dict[str, Any],
    out: Path,
    *extra: str,
    repeats: int = 1,
) -> dict[str, Any]:
    """Bagpipe and the ideal in ``repeats`` pairs of jobs alive at once and run in turns
    (``interleaved``; the ideal's job first in every other pair), so that a slow spell of the machine
    falls on both alike; then no-cache, which no bagpipe/ideal target depends on, alone, in the profile's
    first ``no_cache_rounds``. Each system's jobs are pooled."""
    jobs: dict[str, list[dict[str, Any]]] = {s: [] for s in SYSTEMS}
    for r in range(repeats):
        pair = [(s, [*SYSTEMS[s], *extra]) for s in ("ideal", "bagpipe")]
        pair = pair if r % 2 == 0 else pair[::-1]
        ran = interleaved([(f"{label}-{s}-{r + 1}", flags) for s, flags in pair], profile, out)
        for (s, _), result in zip(pair, ran, strict=True):
            jobs[s].append(result)
    for r in range(min(repeats, profile.get("no_cache_rounds", repeats))):
        jobs["no-cache"].append(job(f"{label}-no-cache-{r + 1}", profile, out, *SYSTEMS["no-cache"], *extra))
    runs = {s: pooled(js) for s, js in jobs.items()}
    return {
        "systems": runs,
        "pair_ratios": [
            b["median_ms"] / i["median_ms"] for b, i in zip(jobs["bagpipe"], jobs["ideal"], strict=True)
        ],
        "bagpipe_over_ideal": runs["bagpipe"]["median_ms"] / runs["ideal"]["median_ms"],
        "no_cache_over_bagpipe": runs["no-cache"]["median_ms"] / runs["bagpipe"]["median_ms"],
        "bagpipe_over_ideal_p90": runs["bagpipe"]["p90_ms"] / runs["ideal"]["p90_ms"],
        "bagpipe_over_ideal_mean": runs["bagpipe"]["mean_ms"] / runs["ideal"]["mean_ms"],
        "no_cache_over_bagpipe_mean": runs["no-cache"]["mean_ms"] / runs["bagpipe"]["mean_ms"],
        "no_cache_over_bagpipe_p90": runs["no-cache"]["p90_ms"] / runs["bagpipe"]["p90_ms"],
    }
