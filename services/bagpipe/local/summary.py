"""A local run's summary: throughput, stage times, cache and traffic figures, failures and recoveries,
re-shardings, CPU per service, and the lines ``bagpipe run`` prints at the end (``summary.json`` holds
the same)."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bagpipe.trainer.metrics import STAGES

if TYPE_CHECKING:
    from bagpipe.local.run_config import RunConfig


def iteration_log(run_dir: Path) -> list[tuple[int, float]]:
    """(batch, loss) of every row of rank 0's iteration log, in the order trained (replays included)."""
    path = run_dir / "metrics" / "trainer-0.csv"
    if not path.is_file():
        return []
    with open(path, newline="") as f:
        return [
            (int(row["batch"]), float(row["loss"]))
            for row in csv.DictReader(f)
            if row.get("batch", "").isdigit()
        ]


def run_losses(run_dir: Path) -> list[float]:
    """The loss of every batch of the run, replayed ones as trained last (they are the ones that count)."""
    by_batch = dict(iteration_log(run_dir))
    return [by_batch[b] for b in sorted(by_batch)]


def recovery_summary(
    failures: list[dict[str, Any]], stats: list[dict[str, Any]], run_dir: Path, every: int, directory: Path
) -> dict[str, Any]:
    """Failures, time to detect and recover, iterations replayed, checkpoint cost (summary and report)."""
    for i, f in enumerate(failures):
        restart = f.get("resumed_at_batch")
        if restart is None:
            restart = failures[i + 1]["start_batch"] if i + 1 < len(failures) else stats[0]["first_batch"]
        # a trainer seals a checkpoint inside a batch's step, before it reports the batch: failed in between,
        # the progress lacks a batch that the checkpoint it resumes from proves trained
        f["last_batch"] = max(f["last_batch"], restart - 1)
        f["resumed_at_batch"] = restart
        f["replayed_iterations"] = max(0, f["last_batch"] + 1 - restart)
    seconds = [c["seconds"] for c in stats[0].get("checkpoints", [])]
    iterations = max(1, stats[0]["iterations"])
    return {
        "failures": failures,
        "failures_detected": len(failures),
        "iterations_replayed": sum(f["replayed_iterations"] for f in failures),
        "checkpoint_every": every,
        "checkpoint_dir": str(directory) if every else None,
        "checkpoints": len(seconds),
        "checkpoint_seconds_per_iteration": sum(seconds) / iterations,
        "checkpoint_seconds_mean": sum(seconds) / len(seconds) if seconds else 0.0,
    }


def resharding_summary(records: list[dict[str, Any]], run_dir: Path) -> dict[str, Any]:
    """Re-shardings of the run, and how long iterations took while rows moved against the rest of the run
    (rank 0's iteration log; the first iterations of each generation, warming up, are left out)."""
    rows = []
    path = run_dir / "metrics" / "trainer-0.csv"
    if path.is_file():
        with open(path, newline="") as f:
            rows = [r for r in csv.DictReader(f) if r.get("batch", "").isdigit()]
    done = [r for r in records if r.get("state") == "done"]
    during: list[float] = []
    other: list[float] = []
    previous = None
    for i, row in enumerate(rows):
        batch, end = int(row["batch"]), float(row["time"])
        fresh = previous is None or batch != previous + 1  # a generation's start
        previous = batch
        if fresh or i < 3:
            continue
        seconds = float(row["iteration_seconds"])
        start = end - seconds
        moving = any(start < r["finished_at"] and end > r["started_at"] for r in done)
        (during if moving else other).append(seconds)
    mean_during = sum(during) / len(during) if during else None
    mean_other = sum(other) / len(other) if other else None
    return {
        "reshards": records,
        "buckets_moved": sum(r.get("buckets_moved", 0) for r in done),
        "rows_moved": sum(r.get("rows_moved", 0) for r in done),
        "bytes_moved": sum(r.get("bytes_moved", 0) for r in done),
        "seconds": sum(r.get("seconds", 0.0) for r in done),
        "iterations_during": len(during),
        "iteration_seconds_during": mean_during,
        "iteration_seconds_otherwise": mean_other,
        "slowdown": mean_during / mean_other if mean_during and mean_other else None,
    }


def cpu_by_service(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """CPU seconds used while training, summed per kind of service (``trainer-1`` counts as ``trainer``):
    on a machine where every service shares the cores, this is where the cycles went."""
    out: dict[str, float] = {}
    for name, seconds in after.items():
        kind = name.rstrip("0123456789").rstrip("-")
        out[kind] = out.get(kind, 0.0) + seconds - before.get(name, 0.0)
    return out


def summarize(
    stats: list[dict[str, Any]], args: RunConfig, run_dir: Path, embedding_servers: int | None = None
) -> dict[str, Any]:
    """Job-wide figures: the slowest trainer's time, mean stage times across trainers. ``embedding_servers``:
    how many serve at the end (re-sharding changes it; default ``--embedding-servers``)."""
    n = len(stats)
    stages = {s: sum(st["stage_seconds_per_iteration"][s] for st in stats) / n for s in STAGES}
    losses = stats[0]["losses"]
    return {
        "run_dir": str(run_dir),
        "iterations": stats[0]["iterations"],
        "trainers": n,
        "embedding_servers": args.embedding_servers if embedding_servers is None else embedding_servers,
        "batch_size": args.batch_size,
        "lookahead": {
            "min": min(st["lookahead"]["min"] for st in stats),
            "max": max(st["lookahead"]["max"] for st in stats),
            "mean": stats[0]["lookahead"]["mean"],
            "requested": args.lookahead,
        },
        "cache_mode": args.cache_mode,
        "sync": args.sync,
        "cache_rows": args.cache_rows,
        "cache_peak_occupancy_rows": max(st["cache_peak_occupancy_rows"] for st in stats),
        "cache_capacity_rows": max(st["cache_capacity_rows"] for st in stats),
        "samples_per_second": min(st["samples_per_second"] for st in stats),
        "seconds_per_iteration": max(st["seconds"] / max(1, st["iterations"]) for st in stats),
        "stage_seconds_per_iteration": stages,
        "cache_hit_rate": sum(st["cache_hit_rate"] for st in stats) / n,
        "rows_per_iteration": stats[0]["unique_rows_per_iteration"],
        "rows_fetched_per_iteration": sum(st["rows_prefetched_per_iteration"] for st in stats),
        # (of them, and of any other lookup of the trainers: rows still initial, computed, not sent)
        "rows_fetched_initial_per_iteration": sum(st.get("rows_initial", 0) for st in stats)
        / max(1, stats[0]["iterations"]),
        # (of them: rows the plans marked as used for the first time, computed without asking the servers)
        "rows_fetched_first_per_iteration": sum(st.get("rows_first", 0) for st in stats)
        / max(1, stats[0]["iterations"]),
        "rows_private_per_iteration": sum(st["rows_private_per_iteration"] for st in stats),
        "rows_synced_critical_per_iteration": stats[0]["rows_synced_critical_per_iteration"],
        "rows_synced_background_per_iteration": stats[0]["rows_synced_background_per_iteration"],
        "rows_handed_over": stats[0]["rows_handed_over"],
        "lookup_calls_per_iteration": sum(st.get("lookup_calls", 0) for st in stats)
        / max(1, stats[0]["iterations"]),
        "write_back_calls_per_iteration": sum(st.get("write_back_calls", 0) for st in stats)
        / max(1, stats[0]["iterations"]),
        "rows_written_back_per_iteration": sum(st["rows_written_back_per_iteration"] for st in stats),
        "first_loss": losses[0] if losses else None,
        "final_loss": sum(losses[-10:]) / len(losses[-10:]) if losses else None,
        "losses": losses,
    }


def format_summary(s: dict[str, Any]) -> str:
    asked = s["lookahead"]["requested"]
    requested = "automatic" if asked is None else f"at most {asked}"
    lines = [
        f"run directory        {s['run_dir']}  (report: {s.get('report', '-')})",
        f"iterations           {s['iterations']}  ({s['trainers']} trainers, {s['embedding_servers']} "
        "embedding servers, "
        f"batch {s['batch_size']})",
        f"lookahead L          {s['lookahead']['mean']:.1f} mean, "
        f"{s['lookahead']['min']}..{s['lookahead']['max']} ({requested})",
        f"cache                {s['cache_mode']}, {s['sync']} sync; peak "
        f"{s['cache_peak_occupancy_rows']:,} rows cached, "
        f"{s['cache_capacity_rows']:,} allocated"
        + (f" (--cache-rows {s['cache_rows']:,})" if s["cache_rows"] else ""),
        f"samples/s            {s['samples_per_second']:,.0f}",
        f"time per iteration   {1000 * s['seconds_per_iteration']:.1f} ms",
    ]
    for stage, sec in s["stage_seconds_per_iteration"].items():
        lines.append(f"  {stage:<18} {1000 * sec:8.2f} ms")
    lines += [
        f"cache hit rate       {100 * s['cache_hit_rate']:.1f}%",
        f"rows per iteration   {s['rows_per_iteration']:,.0f} used, "
        f"{s['rows_fetched_per_iteration']:,.0f} fetched "
        f"({s['rows_fetched_first_per_iteration']:,.0f} used for the first time: computed, not asked "
        f"for; {s['rows_fetched_initial_per_iteration']:,.0f} more still initial: computed, not sent), "
        f"{s['rows_written_back_per_iteration']:,.0f} written back",
        f"transfer calls       {s['lookup_calls_per_iteration']:.2f} fetches, "
        f"{s['write_back_calls_per_iteration']:.2f} "
        "write-backs per iteration (all trainers; each goes to every shard that holds rows of it)",
        f"rows synchronised    {s['rows_synced_critical_per_iteration']:,.0f} critical, "
        f"{s['rows_synced_background_per_iteration']:,.0f} background, "
        f"{s['rows_private_per_iteration']:,.0f} updated by one trainer only (per iteration)",
    ]
    if s.get("cpu_seconds_per_iteration"):
        lines.append(
            "cpu per iteration    "
            + ", ".join(
                f"{kind} {1000 * sec:.1f} ms" for kind, sec in sorted(s["cpu_seconds_per_iteration"].items())
            )
        )
    moved = (s.get("resharding") or {}).get("reshards") or []
    if moved:
        r = s["resharding"]
        slowdown = f", iterations meanwhile {r['slowdown']:.2f}x the others" if r.get("slowdown") else ""
        lines.append(
            f"re-sharding          {len(moved)} time(s), {r['buckets_moved']} buckets, "
            f"{r['rows_moved']:,} rows, "
            f"{r['bytes_moved'] / 2**20:.1f} MiB in {r['seconds']:.1f} s{slowdown}"
        )
    if s["first_loss"] is not None:
        lines.append(
            f"loss                 {s['first_loss']:.4f} first, {s['final_loss']:.4f} last (mean of the "
            "last 10)"
        )
    if s.get("evaluations"):
        e = s["evaluations"][-1]
        lines.append(
            f"held-out             logloss {e['logloss']:.4f}, AUC {e['auc']:.4f} after {e['batches']} "
            "batches "
            f"({e['samples']:,} samples; {len(s['evaluations'])} evaluation(s))"
        )
    return "\n".join(lines)
