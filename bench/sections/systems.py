"""Section ``systems``: ideal, bagpipe and no-cache on loopback (2 trainers, 2 embedding servers), and
what Bagpipe's consistent checkpoints cost (every job elsewhere runs without them, as the ideal system
has none). Its table and plot also hold the limited links of section ``network``, measured alike."""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from bagpipe.config_args import DEFAULT_CHECKPOINT_EVERY, DEFAULT_TRANSFER_BATCHES
from suite.compare import SYSTEMS, compare
from suite.interleave import interleaved
from suite.report import pyplot


def run(profile: dict[str, Any], out: Path) -> dict[str, Any]:
    """The three systems on loopback (``compare``), then bagpipe with and without checkpoints in turns."""
    loopback = compare("loopback", profile, out, repeats=profile["repeats"])
    every = str(DEFAULT_CHECKPOINT_EVERY)
    # what consistent checkpoints cost: bagpipe with and without them, a pair run in turns
    without, with_checkpoints = interleaved(
        [
            ("loopback-bagpipe-without-checkpoints", []),
            (f"loopback-bagpipe-checkpoint-every-{every}", ["--checkpoint-every", every]),
        ],
        profile,
        out,
    )
    loopback["bagpipe_with_checkpoints"] = {
        "checkpoint_every": DEFAULT_CHECKPOINT_EVERY,
        **with_checkpoints,
        "without_median_ms": without["median_ms"],
        "over_bagpipe": with_checkpoints["median_ms"] / without["median_ms"],
    }
    return {"loopback": loopback}


def compared_regimes(results: dict[str, Any]) -> dict[str, Any]:
    """Every regime the three systems were compared in: loopback, and the links of section network."""
    return {
        **results.get("systems", {}),
        **{k: v for k, v in results.get("network", {}).items() if k != "skipped"},
    }


def by_phase(result: dict[str, Any], period: int = DEFAULT_TRANSFER_BATCHES) -> list[dict[str, float]]:
    """Iteration times by ``batch % period``: with grouped transfers each trainer fetches and writes back
    at fixed phases of the group (trainer/pipeline.py), so this shows which iterations pay for them."""
    times: list[list[float]] = [[] for _ in range(period)]
    for batch, ms in zip(result.get("iteration_batch", []), result["iteration_ms"], strict=True):
        times[batch % period].append(ms)
    return [
        {"median_ms": statistics.median(t), "mean_ms": statistics.fmean(t), "iterations": len(t)}
        if t
        else {"median_ms": math.nan, "mean_ms": math.nan, "iterations": 0}
        for t in times
    ]


def table(results: dict[str, Any]) -> list[str]:
    """Each regime's times and ratios, then by phase of the transfers, the cost of checkpoints, the
    stages, the rows fetched and the CPU per iteration."""
    regimes = compared_regimes(results)
    if not regimes:
        return []
    lines = [
        "| regime | ideal median / mean / p90 (ms) | bagpipe median / mean / p90 (ms) | no-cache "
        "median / mean / p90 (ms) "
        "| bagpipe/ideal (median; mean) | no-cache/bagpipe (median; mean) |",
        "|---|---|---|---|---|---|",
    ]
    for regime, r in regimes.items():
        s = r["systems"]
        lines.append(
            f"| {regime} | "
            + " | ".join(
                f"{s[n]['median_ms']:.1f} / {s[n]['mean_ms']:.1f} / {s[n]['p90_ms']:.1f}" for n in SYSTEMS
            )
            + f" | {r['bagpipe_over_ideal']:.2f}x; {r['bagpipe_over_ideal_mean']:.2f}x"
            f" | {r['no_cache_over_bagpipe']:.2f}x; {r['no_cache_over_bagpipe_mean']:.2f}x |"
        )
    phases = {
        (regime, n): by_phase(r["systems"][n])
        for regime, r in regimes.items()
        for n in ("ideal", "bagpipe")
        if r["systems"][n].get("iteration_batch")
    }
    if phases:  # which iterations the transfers land on: batch % --transfer-batches
        width = max(len(p) for p in phases.values())
        lines += [
            "",
            f"Mean iteration time (ms) by batch % {DEFAULT_TRANSFER_BATCHES} (`--transfer-batches`): "
            "trainer 0 fetches at phase 0 and writes back at 4, trainer 1 writes back at 2 and fetches "
            "at 6; a write-back's progress report also releases the plans that waited on it.",
            "",
            "| regime | system | " + " | ".join(str(i) for i in range(width)) + " |",
            "|---|---|" + "---|" * width,
        ]
        for (regime, n), p in phases.items():
            lines.append(f"| {regime} | {n} | " + " | ".join(f"{x['mean_ms']:.1f}" for x in p) + " |")
    checkpointed = results.get("systems", {}).get("loopback", {}).get("bagpipe_with_checkpoints")
    if checkpointed:
        lines += [
            "",
            "All systems above run without consistent checkpoints (the ideal system cannot take them). "
            f"Bagpipe on loopback with one every {checkpointed['checkpoint_every']} batches (the default "
            f"of `bagpipe run`): median {checkpointed['median_ms']:.1f} ms, "
            f"{checkpointed['over_bagpipe']:.2f}x its time without them in the same pair of jobs run in "
            f"turns ({checkpointed.get('without_median_ms', math.nan):.1f} ms); embedding servers' CPU "
            f"{checkpointed['cpu_ms'].get('embedding-server', 0.0):.1f} ms per iteration.",
        ]
    lines += [
        "",
        "Bagpipe's iteration breakdown (ms): "
        + "; ".join(
            f"{regime}: " + ", ".join(f"{k} {v:.1f}" for k, v in r["systems"]["bagpipe"]["stage_ms"].items())
            for regime, r in regimes.items()
        ),
    ]
    loop = regimes.get("loopback", {}).get("systems", {})
    if all("rows_fetched_initial_per_iteration" in loop.get(s, {}) for s in ("bagpipe", "no-cache")):
        lines += [
            "",
            "Rows fetched per iteration (all trainers); of them, used for the first time (computed by "
            "the trainer, not asked for) and still initial (computed by the trainer, not sent): "
            + ", ".join(
                f"{s} {loop[s]['rows_fetched_per_iteration']:,.0f} "
                f"({loop[s].get('rows_fetched_first_per_iteration', 0):,.0f} first, "
                f"{loop[s]['rows_fetched_initial_per_iteration']:,.0f} initial)"
                for s in ("bagpipe", "no-cache")
            )
            + ".",
        ]
    kinds = sorted({k for r in regimes.values() for s in r["systems"].values() for k in s.get("cpu_ms", {})})
    if kinds:  # every service shares this machine's cores: where the CPU time goes, per iteration
        lines += [
            "",
            "| regime | system | " + " | ".join(f"{k} CPU ms" for k in kinds) + " | all CPU ms |",
            "|---|---|" + "---|" * (len(kinds) + 1),
        ]
        for regime, r in regimes.items():
            for name in SYSTEMS:
                cpu = r["systems"][name].get("cpu_ms", {})
                lines.append(
                    f"| {regime} | {name} | "
                    + " | ".join(f"{cpu.get(k, 0):.1f}" for k in kinds)
                    + f" | {sum(cpu.values()):.1f} |"
                )
    return lines


def plots(results: dict[str, Any], out: Path, profile: str) -> list[str]:
    """Stacked stage times per system, one panel per regime."""
    regimes = compared_regimes(results)
    if not regimes:
        return []
    plt = pyplot()
    fig, axes = plt.subplots(1, len(regimes), figsize=(4.5 * len(regimes), 4), squeeze=False)
    for ax, (regime, r) in zip(axes[0], regimes.items(), strict=True):
        names = list(r["systems"])
        stages = list(r["systems"]["bagpipe"]["stage_ms"])
        bottom = [0.0] * len(names)
        for stage in stages:
            vals = [r["systems"][n]["stage_ms"][stage] for n in names]
            ax.bar(names, vals, bottom=bottom, label=stage)
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
        ax.plot(names, [r["systems"][n]["median_ms"] for n in names], "k_", markersize=30, label="median")
        ax.set_title(regime)
        ax.set_ylabel("ms per iteration")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / f"systems-{profile}.png", dpi=100)
    plt.close(fig)
    return [f"systems-{profile}.png"]
