"""Section ``oracle``: the oracle's planning throughput against batch size, number of tables and L
(paper Figure 17), and end to end (the samples' checks, planning, serialising the trainers' plans); at
the target's point (batch 16,384, 26 tables, L=200, 8 trainers) with one planning thread and with
every core. Each point is ``bench/oracle_throughput.py`` in a process of its own. Then oracle shards
(``bench/oracle_shards.py``, its own process): K=1 and K=2 shards at once on this machine's cores, each
shard alone for K up to 16 and 8 to 256 trainers, a trainer's merge of the parts and its bytes."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from bagpipe.oracle_cacher.config import planner_cores
from suite.common import in_own_process, log
from suite.report import Target, pyplot


def oracle_measure(
    batch_size: int, tables: int, lookahead: int, timed: int, replays: int = 1, threads: int = 1
) -> dict[str, Any]:
    """One point of ``bench/oracle_throughput.py``, in a process of its own, as an oracle runs: the
    earlier points' tables (540 MB at 26 tables) and allocator state do not carry into it."""
    return in_own_process(
        "oracle_throughput.py",
        batch_size=batch_size,
        tables=tables,
        lookahead=lookahead,
        timed=timed,
        replays=replays,
        threads=threads,
    )


def oracle_threads() -> list[int]:
    """The target point's planning threads: one (the figure for one core), and every core here (what
    ``--planner-threads`` gives an oracle with the machine to itself)."""
    return sorted({1, planner_cores()})


def run(profile: dict[str, Any], out: Path) -> dict[str, Any]:
    """The sweeps over batch size, tables and L, one planning thread; at the target's point, each
    thread count the best of ``target_repeats`` processes of ``target_replays`` replays."""
    o = profile["oracle"]
    points = []
    for b in o["batches"]:
        points.append(
            {"sweep": "batch", **oracle_measure(batch_size=b, tables=26, lookahead=50, timed=o["timed"])}
        )
    for t in o["tables"]:
        points.append(
            {"sweep": "tables", **oracle_measure(batch_size=16384, tables=t, lookahead=50, timed=o["timed"])}
        )
    for lookahead in o["lookaheads"]:
        if lookahead != 200:
            point = oracle_measure(batch_size=16384, tables=26, lookahead=lookahead, timed=o["timed"])
            points.append({"sweep": "lookahead", **point})
            continue
        for threads in oracle_threads():  # the target's point: the best of target_repeats processes'
            runs = [  # target_replays replays each
                oracle_measure(
                    batch_size=16384,
                    tables=26,
                    lookahead=200,
                    timed=o["target_timed"],
                    replays=o.get("target_replays", 1),
                    threads=threads,
                )
                for _ in range(o.get("target_repeats", 1))
            ]
            point = max(runs, key=lambda r: r["end_to_end_samples_per_second"])
            point["end_to_end_runs"] = [
                r["end_to_end_samples_per_second"] for run in runs for r in run["replays"]
            ]
            points.append({"sweep": "lookahead" if threads == 1 else "threads", **point})
    for p in points:
        log(
            f"oracle {p['sweep']}: batch {p['batch_size']}, {p['tables']} tables, L={p['lookahead']}, "
            f"{p.get('threads', 1)} thread(s): {p['samples_per_second'] / 1e6:.2f} M samples/s planning, "
            f"{p['end_to_end_samples_per_second'] / 1e6:.2f} M end to end (samples checked, plan, serialised)"
        )
    for target in oracle_targets(points):
        every = target.get("end_to_end_runs", [target["end_to_end_samples_per_second"]])
        runs = ", ".join(f"{r / 1e6:.2f}" for r in every)
        log(
            f"oracle end to end at batch 16384, 26 tables, L=200, 8 trainers, {target.get('threads', 1)} "
            f"thread(s): {target['end_to_end_samples_per_second'] / 1e6:.2f} M samples/s (the best of "
            f"{runs} M; median {statistics.median(every) / 1e6:.2f} M)"
        )
    shards = in_own_process(
        "oracle_shards.py",
        oracles="1,2,4,8,16",
        trainers="8,64,256",
        concurrent="1,2",
        timed=o.get("shards_timed", 100),
        concurrent_timed=o.get("target_timed", 200),
        repeats=5,
    )
    for line in shards_lines(shards):
        log(line)
    return {"points": points, "paper_samples_per_second": 3.27e6, "shards": shards}


def shards_lines(shards: dict[str, Any]) -> list[str]:
    """The shards' figures in a line each: measured at once, then each point computed from one at a time."""
    lines = [
        f"oracle shards at once, 8 trainers: K={p['oracles']} on {p['cores']} core(s) "
        f"{p['samples_per_second'] / 1e6:.2f} M samples/s (measured)"
        for p in shards.get("concurrent", [])
    ]
    if "speedup_2_over_1" in shards:
        lines.append(f"oracle shards: K=2 on 2 cores / K=1 on 1: {shards['speedup_2_over_1']:.2f}x")
    lines += [
        f"oracle shards, {p['trainers']} trainers, K={p['oracles']}: {p['samples_per_second'] / 1e6:.2f} M "
        f"samples/s on {p['oracles']} core(s) (computed), {p['bytes_per_trainer_per_batch'] / 1e6:.3f} MB "
        f"a trainer a batch, its merge {p['trainer_ms_per_batch']:.3f} ms"
        for p in shards.get("points", [])
        if "refused" not in p
    ]
    return lines


def shard_point(shards: dict[str, Any], trainers: int, oracles: int) -> dict[str, Any] | None:
    return next(
        (
            p
            for p in shards.get("points", [])
            if p.get("trainers") == trainers and p.get("oracles") == oracles
        ),
        None,
    )


def oracle_targets(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The points at the target's point (batch 16,384, 26 tables, L=200, 8 trainers), fewest threads
    first."""
    at = [
        p
        for p in points
        if (p["batch_size"], p["tables"], p["lookahead"], p["trainers"]) == (16384, 26, 200, 8)
    ]
    return sorted(at, key=lambda p: p.get("threads", 1))


def table(results: dict[str, Any]) -> list[str]:
    """Every point of the sweeps, planning alone and end to end; the shards' rates and a trainer's side."""
    if "oracle" not in results:
        return []
    shards = results["oracle"].get("shards", {})
    lines = [
        "",
        "| oracle sweep | batch | tables | L | threads | M samples/s planning | ms per batch | "
        "M samples/s end to end |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {p['sweep']} | {p['batch_size']} | {p['tables']} | {p['lookahead']} | "
        f"{p.get('threads', 1)} | {p['samples_per_second'] / 1e6:.2f} | {p['median_ms_per_batch']:.2f} | "
        f"{p['end_to_end_samples_per_second'] / 1e6:.2f} |"
        for p in results["oracle"]["points"]
    ]
    if shards.get("points"):
        oracles = sorted({p["oracles"] for p in shards["points"] if "oracles" in p})
        lines += [
            "",
            "| oracle shards (computed from each shard alone) | "
            + " | ".join(f"K={k}, M samples/s" for k in oracles)
            + " | MB a trainer a batch | a trainer's merge at the largest K, ms |",
            "|---|" + "---|" * (len(oracles) + 2),
        ]
        for trainers in sorted({p["trainers"] for p in shards["points"]}):
            cells = [shard_point(shards, trainers, k) for k in oracles]
            if not any(cells):
                continue
            rates = [f"{c['samples_per_second'] / 1e6:.2f}" if c else "refused" for c in cells]
            last = next(c for c in reversed(cells) if c)
            mb, ms = last["bytes_per_trainer_per_batch"] / 1e6, last["trainer_ms_per_batch"]
            lines.append(f"| {trainers} trainers | {' | '.join(rates)} | {mb:.3f} | {ms:.3f} |")
        for p in shards.get("concurrent", []):
            lines.append(
                f"| measured at once: K={p['oracles']} on {p['cores']} core(s), 8 trainers | "
                f"{p['samples_per_second'] / 1e6:.2f} |" + " |" * (len(oracles) + 1)
            )
    return lines


def targets(results: dict[str, Any]) -> tuple[list[Target], list[str]]:
    """End to end at the target's point with every core planning, and each thread count's replays."""
    rows: list[Target] = []
    notes: list[str] = []
    oracle = oracle_targets(results.get("oracle", {}).get("points", []))
    if oracle:  # the goal with every core here planning; one core's figure beside it
        best = oracle[-1]
        r = best["end_to_end_samples_per_second"] / 1e6
        name = f"oracle end to end, M samples/s ({best.get('threads', 1)} planning threads)"
        rows.append((name, r, ">= 10.0", r >= 10.0))
        for p in oracle:
            every = p.get("end_to_end_runs", [])
            if len(every) > 1:
                m = statistics.median(every) / 1e6
                notes.append(
                    f"  (the oracle with {p.get('threads', 1)} planning thread(s): best "
                    f"{p['end_to_end_samples_per_second'] / 1e6:.3f} M, median of its {len(every)} replays "
                    f"{m:.3f} M)"
                )
    shards = results.get("oracle", {}).get("shards", {})
    if "speedup_2_over_1" in shards:
        r = shards["speedup_2_over_1"]
        rows.append(
            ("oracle shards: K=2 on 2 cores / K=1 on 1, 8 trainers (measured)", r, ">= 1.8", r >= 1.8)
        )
    merge = shard_point(shards, 8, 8)
    if merge is not None:
        ms = merge["trainer_ms_per_batch"]
        rows.append(("a trainer's receipt and merge of K=8 parts, ms a batch", ms, "<= 1.0", ms <= 1.0))
    few, many = shard_point(shards, 8, 1), shard_point(shards, 256, 1)
    if few is not None and many is not None:
        r = many["bytes_per_trainer_per_batch"] / few["bytes_per_trainer_per_batch"]
        rows.append(("bytes a trainer receives a batch, 256 / 8 trainers", r, "<= 1.00", r <= 1.0))
    return rows, notes


def plots(results: dict[str, Any], out: Path, profile: str) -> list[str]:
    """Planning's time a batch along each sweep, one thread."""
    if "oracle" not in results:
        return []
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    for ax, (sweep, key) in zip(
        axes, (("batch", "batch_size"), ("tables", "tables"), ("lookahead", "lookahead")), strict=True
    ):
        pts = [p for p in results["oracle"]["points"] if p["sweep"] == sweep]  # (one thread)
        ax.plot([p[key] for p in pts], [p["median_ms_per_batch"] for p in pts], "o-")
        ax.set_xlabel(key)
        ax.set_ylabel("ms per batch")
    fig.tight_layout()
    fig.savefig(out / f"oracle-{profile}.png", dpi=100)
    plt.close(fig)
    return [f"oracle-{profile}.png"]
