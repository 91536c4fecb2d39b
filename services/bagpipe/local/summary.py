"""A local run's summary: throughput, stage times, cache and traffic figures, failures and recoveries,
re-shardings, CPU per service, and the lines ``bagpipe run`` prints at the end (``summary.json`` holds
the same).

Warm-up: the first iterations of a trainer are slow for reasons the rest of the run does not share (the
first plans wait for the data processors and the oracle's window to fill, the first lookups, compiling).
``warm_up`` is the rule that tells them apart: in each stretch of consecutive batches a trainer trained
(the run, or a generation after a recovery: its trainers start again), the first iteration and every one
right after it slower than ``WARM_UP_FACTOR`` times the median of the stretch's second half, at most half
the stretch. The summary's steady state (``steady_state``) is every other iteration; the report draws
the warm-up apart by the same rule.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bagpipe.trainer.metrics import STAGES

if TYPE_CHECKING:
    from bagpipe.local.run_config import RunConfig

# an iteration at the start of a stretch slower than this many times the stretch's steady median is warm-up
WARM_UP_FACTOR = 3.0


def read_iterations(path: Path) -> dict[str, list[float]]:
    """A trainer's per-iteration log (``metrics/trainer-<rank>.csv``) as columns of floats."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        return {}
    return {k: [float(r[k]) for r in rows] for k in rows[0]}


def trainer_logs(run_dir: Path) -> dict[int, dict[str, list[float]]]:
    """Every trainer's per-iteration log that holds a row, by rank."""
    paths = sorted((run_dir / "metrics").glob("trainer-*.csv"), key=lambda p: int(p.stem.split("-")[1]))
    logs = {int(p.stem.split("-")[1]): read_iterations(p) for p in paths}
    return {rank: cols for rank, cols in logs.items() if cols}


def warm_up(iteration_seconds: list[float]) -> int:
    """How many iterations at the start of a stretch of training are its warm-up: the first, and each one
    right after it slower than ``WARM_UP_FACTOR`` times the median of the stretch's second half, at most
    half the stretch (none with fewer than two iterations)."""
    n = len(iteration_seconds)
    if n < 2:
        return 0
    later = sorted(iteration_seconds[n // 2 :])
    steady = later[len(later) // 2]
    start = 1
    while start < n // 2 and iteration_seconds[start] > WARM_UP_FACTOR * steady:
        start += 1
    return start


def _stretches(batches: list[float]) -> list[tuple[int, int]]:
    """[start, end) of each run of consecutive batches in a trainer's log (a recovery's replay starts
    another)."""
    cuts = [i for i in range(1, len(batches)) if batches[i] != batches[i - 1] + 1]
    edges = [0, *cuts, len(batches)]
    return list(zip(edges[:-1], edges[1:], strict=True))


def steady_state(logs: list[dict[str, list[float]]]) -> dict[str, Any] | None:
    """The trainers' steady state and warm-up (see ``warm_up``) from their per-iteration logs (columns:
    ``batch``, ``iteration_seconds``, ``<stage>_seconds``), job-wide as the summary's other figures: the
    slowest trainer's mean iteration and the mean over trainers of each stage, over the iterations after
    the warm-up; the warm-up of the trainer whose warm-up took longest, its iterations and seconds. The
    time of an iteration is its stages' (a checkpoint or an evaluation between two batches is not in it).
    None without a row."""
    parts = []
    for cols in logs:
        if not cols.get("batch"):
            continue
        warm: list[int] = []
        steady: list[int] = []
        for start, end in _stretches(cols["batch"]):
            k = warm_up(cols["iteration_seconds"][start:end])
            warm += range(start, start + k)
            steady += range(start + k, end)
        parts.append((cols, warm, steady))
    if not parts:
        return None

    def mean(cols: dict[str, list[float]], key: str, rows: list[int]) -> float:
        return sum(cols[key][i] for i in rows) / len(rows) if rows else 0.0

    def warm_seconds(part: tuple[dict[str, list[float]], list[int], list[int]]) -> float:
        return sum(part[0]["iteration_seconds"][i] for i in part[1])

    longest = max(parts, key=warm_seconds)
    return {
        "steady_state": {
            "iterations": min(len(steady) for _, _, steady in parts),
            "seconds_per_iteration": max(mean(c, "iteration_seconds", steady) for c, _, steady in parts),
            "stage_seconds_per_iteration": {
                s: sum(mean(c, f"{s}_seconds", steady) for c, _, steady in parts) / len(parts) for s in STAGES
            },
        },
        "warm_up": {"iterations": len(longest[1]), "seconds": warm_seconds(longest)},
    }


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
    steady = steady_state(list(trainer_logs(run_dir).values())) or {}
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
        # (over the whole run: the warm-up, checkpoints and evaluations in it)
        "seconds_per_iteration": max(st["seconds"] / max(1, st["iterations"]) for st in stats),
        "stage_seconds_per_iteration": stages,
        "steady_state": steady.get("steady_state"),
        "warm_up": steady.get("warm_up"),
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
    ]
    steady, warm = s.get("steady_state"), s.get("warm_up")
    whole = f"{1000 * s['seconds_per_iteration']:.1f} ms"
    if steady:
        lines.append(
            f"time per iteration   {1000 * steady['seconds_per_iteration']:.1f} ms in the steady state "
            f"({steady['iterations']:,} iterations; {whole} over the whole run, warm-up and checkpoints "
            "included)"
        )
        stages = steady["stage_seconds_per_iteration"]
    else:
        lines.append(f"time per iteration   {whole}")
        stages = s["stage_seconds_per_iteration"]
    for stage, sec in stages.items():
        lines.append(f"  {stage:<18} {1000 * sec:8.2f} ms")
    if warm and warm["iterations"]:
        lines.append(
            f"warm-up              {warm['iterations']} iteration(s), {1000 * warm['seconds']:.1f} ms in all "
            "(the first plans, lookups and compiling; not in the steady state)"
        )
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
