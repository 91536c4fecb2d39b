"""Section ``lookahead``: bagpipe alone at each of the profile's L (5 .. 300): peak cache rows and time
per iteration (paper Table 3)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bagpipe.config_args import DEFAULT_MAX_LOOKAHEAD
from suite.jobs import job
from suite.report import pyplot


def run(profile: dict[str, Any], out: Path) -> dict[str, Any]:
    """One job for each L, of L plus the profile's ``lookahead_extra`` iterations."""
    runs = []
    for lookahead in profile["lookaheads"]:
        r = job(
            f"lookahead-{lookahead}",
            profile,
            out,
            "--lookahead",
            str(lookahead),
            "--max-lookahead",  # (the window's cap; L above the default cap of 200 must raise it)
            str(max(lookahead, DEFAULT_MAX_LOOKAHEAD)),
            iterations=lookahead + profile["lookahead_extra"],
        )
        runs.append({**r, "L": lookahead})
    return {"runs": runs}


def table(results: dict[str, Any]) -> list[str]:
    """The cache and the time per iteration at each L."""
    if "lookahead" not in results:
        return []
    lines = ["", "| L | peak cache rows | cache slots | median ms | p90 ms |", "|---|---|---|---|---|"]
    lines += [
        f"| {r['L']} | {r['cache_peak_occupancy_rows']:,} | {r['cache_capacity_rows']:,} | "
        f"{r['median_ms']:.1f} | {r['p90_ms']:.1f} |"
        for r in results["lookahead"]["runs"]
    ]
    return lines


def plots(results: dict[str, Any], out: Path, profile: str) -> list[str]:
    """Peak cache rows and median time per iteration against L."""
    if "lookahead" not in results:
        return []
    plt = pyplot()
    runs = results["lookahead"]["runs"]
    fig, ax1 = plt.subplots(figsize=(7, 4))
    ax1.plot(
        [r["L"] for r in runs],
        [r["cache_peak_occupancy_rows"] for r in runs],
        "o-",
        label="peak cache rows",
    )
    ax1.set_xlabel("L")
    ax1.set_ylabel("peak cache rows")
    ax2 = ax1.twinx()
    ax2.plot([r["L"] for r in runs], [r["median_ms"] for r in runs], "s--", color="C1", label="ms/iteration")
    ax2.set_ylabel("median ms per iteration")
    fig.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(out / f"lookahead-{profile}.png", dpi=100)
    plt.close(fig)
    return [f"lookahead-{profile}.png"]
