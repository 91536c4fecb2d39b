"""Section ``skew``: ideal, bagpipe and no-cache at each skew of the profile, the top 1% of rows taking
90% .. 1% of the accesses and Zipf alpha 1 .. 5 (paper Figures 18 and 19); bagpipe's and the ideal's jobs
alive at once and run in turns (``interleaved``), so that both meet the machine at the same speed."""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from suite.compare import compare
from suite.report import Target, pyplot


def run(profile: dict[str, Any], out: Path) -> dict[str, Any]:
    """Each point's systems as ``compare`` runs them, in ``skew_rounds`` pairs. A point's bagpipe/ideal is
    the ratio of the two systems' medians over every pair's measured iterations, as in the other sections;
    the spread is a max over min of six of them. Each pair's own ratio is kept beside it, with the spread
    of their medians per point."""
    settings = [
        (
            f"top 1% = {100 * share:g}%",
            "hot",
            share,
            f"hot-{share:g}",
            ["--hot-fraction", "0.01", "--hot-share", str(share)],
        )
        for share in profile["hot_shares"]
    ] + [
        (f"zipf {alpha:g}", "zipf", alpha, f"zipf-{alpha:g}", ["--zipf-alpha", str(alpha)])
        for alpha in profile["zipf_alphas"]
    ]
    points = []
    rounds = profile["skew_rounds"]
    for skew, kind, value, label, flags in settings:
        compared = compare(label, profile, out, *flags, repeats=rounds)
        runs, paired = compared["systems"], compared["pair_ratios"]
        points.append(
            {
                "skew": skew,
                "kind": kind,
                "value": value,
                **runs,
                "bagpipe_over_ideal": compared["bagpipe_over_ideal"],
                "round_ratios": paired,
                "paired_bagpipe_over_ideal": statistics.median(paired),
            }
        )
    times = [p["bagpipe"]["median_ms"] for p in points]
    ideal = [p["ideal"]["median_ms"] for p in points]
    over = [p["bagpipe_over_ideal"] for p in points]
    paired = [p["paired_bagpipe_over_ideal"] for p in points]
    return {
        "points": points,
        "rounds": rounds,
        "interleaved": True,
        "bagpipe_spread": max(times) / min(times) - 1,
        "ideal_spread": max(ideal) / min(ideal) - 1,
        "bagpipe_over_ideal_spread": max(over) / min(over) - 1,
        "paired_bagpipe_over_ideal_spread": max(paired) / min(paired) - 1,
    }


def table(results: dict[str, Any]) -> list[str]:
    """Each point's systems, with each pair's bagpipe/ideal, and the spreads across the sweep."""
    if "skew" not in results:
        return []
    lines = [
        "",
        "| skew | unique rows per batch | ideal median ms | bagpipe median ms | no-cache median ms "
        "| bagpipe/ideal | no-cache/bagpipe |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {p['skew']} | {p['bagpipe']['rows_per_iteration']:,.0f} | {p['ideal']['median_ms']:.1f} | "
        f"{p['bagpipe']['median_ms']:.1f} | "
        f"{p['no-cache']['median_ms']:.1f} | "
        f"{p['bagpipe']['median_ms'] / p['ideal']['median_ms']:.2f}x "
        f"({', '.join(f'{r:.2f}' for r in p.get('round_ratios', []))}) | "
        f"{p['no-cache']['median_ms'] / p['bagpipe']['median_ms']:.2f}x |"
        for p in results["skew"]["points"]
    ]
    sk = results["skew"]
    lines.append(
        "\nBagpipe's and the ideal's jobs ran in turns, in pairs (no-cache's alone); the medians pool "
        "every pair's measured iterations; in brackets, each pair's bagpipe over ideal median. Across "
        f"the skew sweep (max/min - 1): bagpipe's time varies by {100 * sk['bagpipe_spread']:.1f}% "
        f"(paper: at most 13%), the ideal system's by {100 * sk['ideal_spread']:.1f}%, and "
        f"bagpipe/ideal by {100 * sk['bagpipe_over_ideal_spread']:.1f}% "
        f"({100 * sk.get('paired_bagpipe_over_ideal_spread', math.nan):.1f}% by the median of each "
        "point's pair ratios)."
    )
    return lines


def targets(results: dict[str, Any]) -> tuple[list[Target], list[str]]:
    """The spread of bagpipe/ideal across the sweep."""
    if "bagpipe_over_ideal_spread" not in results.get("skew", {}):
        return [], []
    r = results["skew"]["bagpipe_over_ideal_spread"]
    return [("bagpipe/ideal spread across the skew sweep", r, "<= 0.10", r <= 0.10)], []


def plots(results: dict[str, Any], out: Path, profile: str) -> list[str]:
    """The three systems' median time at each point."""
    if "skew" not in results:
        return []
    plt = pyplot()
    pts = results["skew"]["points"]
    fig, ax = plt.subplots(figsize=(9, 4))
    x = range(len(pts))
    for k, (system, w) in enumerate((("ideal", -0.27), ("bagpipe", 0.0), ("no-cache", 0.27))):
        ax.bar([i + w for i in x], [p[system]["median_ms"] for p in pts], 0.27, label=system, color=f"C{k}")
    ax.set_xticks(list(x), [p["skew"] for p in pts], rotation=30, fontsize=8)
    ax.set_ylabel("median ms per iteration")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / f"skew-{profile}.png", dpi=100)
    plt.close(fig)
    return [f"skew-{profile}.png"]
