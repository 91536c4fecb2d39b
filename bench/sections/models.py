"""Section ``models``: ideal, bagpipe and no-cache for each model (DLRM, Wide&Deep, DeepFM, Deep&Cross)
at the profile's embedding sizes, each with its own dense part (paper Figure 10)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from suite.compare import compare


def run(profile: dict[str, Any], out: Path) -> dict[str, Any]:
    """Each model with its own dense part (the profile's embedding sizes and optimizer)."""
    dim = [
        "--embedding-dim",
        dict(zip(profile["model"][::2], profile["model"][1::2], strict=True))["--embedding-dim"],
    ]
    results = {}
    for model, flags in profile["models"].items():
        sized = {
            **profile,
            "model": profile["model"] if model == "dlrm" else dim,
            "iterations": profile["model_iterations"],
            "pair_iterations": profile["model_pair_iterations"],
        }
        results[model] = compare(f"model-{model}", sized, out, "--model", model, *flags)
    return results


def table(results: dict[str, Any]) -> list[str]:
    """Each model's three systems and their ratios."""
    if "models" not in results:
        return []
    lines = [
        "",
        "| model | ideal median ms | bagpipe median ms | no-cache median ms | bagpipe/ideal | "
        "no-cache/bagpipe |",
        "|---|---|---|---|---|---|",
    ]
    for model, r in results["models"].items():
        s = r["systems"]
        lines.append(
            f"| {model} | {s['ideal']['median_ms']:.1f} | {s['bagpipe']['median_ms']:.1f} | "
            f"{s['no-cache']['median_ms']:.1f} | {r['bagpipe_over_ideal']:.2f}x | "
            f"{r['no_cache_over_bagpipe']:.2f}x |"
        )
    return lines
