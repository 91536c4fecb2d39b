"""Section ``tier``: tables larger than memory. Every row is stored (each job starts from a saved model of
the profile's tables, so no row is left to compute from its seed), and each embedding server keeps only
``--row-memory`` of its shard's rows and optimizer state in memory, the rest on this machine's disk.

Jobs: every row in memory (the reference); Bagpipe's tier (``--row-policy lookahead``) at each fraction of
the shard; and at the goal's fraction the two baselines in the same server, history-based eviction with
reads on demand (``lru``, as multi-tier stores do) and next-batch prefetch with LRU eviction (``next-batch``,
as SSD-backed TorchRec kernels do). From each server's last scrape (read from outside the process): rows
read ahead, rows a fetch waited for, read-aheads wasted, rows written, disk bytes, and resident memory."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from bagpipe.cli import parse_run
from bagpipe.core.data import scaled_table_rows
from bagpipe.core.optim_config import OptimizerConfig
from bagpipe.local.launcher import run as run_job
from suite.common import log
from suite.interleave import interleaved
from suite.jobs import job, job_argv
from suite.link import HOST_IP, NS_IP, limited_link
from suite.report import Target

SERVERS = 2


def shard_bytes(profile: dict[str, Any], scale: str) -> int:
    """One server's rows and optimizer state, in bytes (the profile's model, dim and optimizer)."""
    dim = int(profile["model"][profile["model"].index("--embedding-dim") + 1])
    optimizer = OptimizerConfig(name=profile["optimizer"][profile["optimizer"].index("--optimizer") + 1])
    rows = sum(scaled_table_rows(float(scale)))
    return math.ceil(rows / SERVERS) * 4 * (dim + optimizer.state_width(dim))


def scraped(run_dir: Path) -> dict[str, float]:
    """The servers' tier figures and resident memory from their last scrapes, summed over the servers
    (resident memory and the budget: the largest)."""
    totals: dict[str, float] = {}
    for path in sorted((run_dir / "metrics").glob("embedding_server-*.prom")):
        text = path.read_text()
        for m in re.finditer(
            r"^bagpipe_embedding_server_tier_(\w+?)(?:_total)?(?:\{op=\"(\w+)\"\})? (\S+)$", text, re.M
        ):
            key = m.group(1) + (f"_{m.group(2)}" if m.group(2) else "")
            totals[key] = totals.get(key, 0.0) + float(m.group(3))
        rss = re.search(r"^process_resident_memory_bytes (\S+)$", text, re.M)
        if rss:
            totals["resident_bytes"] = max(totals.get("resident_bytes", 0.0), float(rss.group(1)))
    return totals


def _figures(result: dict[str, Any], run_dir: Path, iterations: int, batch: int) -> dict[str, Any]:
    """One profile job's figures: its timings (``job`` or ``interleaved``'s) and its servers' last scrape."""
    figures = scraped(run_dir)
    reads = figures.get("rows_prefetched", 0.0) + figures.get("rows_waited", 0.0)
    samples = iterations * batch
    return {
        "median_ms": result["median_ms"],
        "cpu_ms": result.get("cpu_ms", {}),
        # the trainers' wait for their prefetched rows (the pipeline fetches a transfer group ahead)
        "prefetch_wait_ms": result["stage_ms"].get("prefetch_wait", math.nan),
        # the servers' requests' wait for rows not in memory when asked for, summed over the servers
        "fetch_disk_wait_ms": 1000 * figures.get("fetch_wait_seconds", 0.0) / iterations,
        "rows_read": reads,
        "rows_waited": figures.get("rows_waited", 0.0),
        "rows_wasted": figures.get("rows_wasted", 0.0),
        # every read but the read-aheads evicted unused: those the run could not have done without
        "reads_over_needed": reads / max(1.0, reads - figures.get("rows_wasted", 0.0)),
        "rows_written": figures.get("rows_written", 0.0),
        "disk_bytes_written_per_sample": figures.get("disk_bytes_write", 0.0) / samples,
        "disk_bytes_read_per_sample": figures.get("disk_bytes_read", 0.0) / samples,
        "rows_on_disk": figures.get("rows_on_disk", 0.0),
        "resident_bytes": figures.get("resident_bytes", math.nan),
        "scraped": figures,
    }


def _policy(policy: str, budget: int) -> tuple[str, ...]:
    return ("--row-memory", str(budget), "--row-policy", policy)


def run(profile: dict[str, Any], out: Path) -> dict[str, Any]:
    settings = profile["tier"]
    scale, iterations = settings["scale"], settings["iterations"]
    # (the goal's point may take a model and batch of its own: the paper's DLRM at >= 4 GB on disk)
    own = {k: settings[k] for k in ("model", "batch") if k in settings}
    profile = {**profile, **own, "scale": scale, "pair_iterations": settings["pair_iterations"]}
    saved = out / "runs" / "tier-model.pt"
    run_job(parse_run(job_argv("tier-save", profile, out, "--save-initial", str(saved), iterations=1)[1:]))
    # (every job's servers at normal priority, as --row-memory puts them: the reference's too)
    # (a job frozen while its pair's other runs must not take the freeze for a failure: the medium profile's
    # iterations, 0.4 s, outlast the thaws that show a held job's progress)
    start = ["--init-from", str(saved), "--embedding-server-priority", "normal", "--failure-timeout", "300"]
    per_server = shard_bytes(profile, scale)
    log(f"tier: {SERVERS} servers of {per_server / 2**20:.0f} MiB of rows and state each")
    goal = max(1 << 20, int(per_server * settings["goal"]))

    # the budget swept, each job alone (the figure of iteration time against the budget)
    sweep = []
    for fraction in settings["fractions"]:
        budget = max(1 << 20, int(per_server * fraction))
        name = f"tier-lookahead-{fraction:g}"
        result = job(name, profile, out, *start, *_policy("lookahead", budget), iterations=iterations)
        sweep.append(
            {
                "fraction": fraction,
                "budget_bytes": budget,
                **_figures(result, out / "runs" / name, iterations, profile["batch"]),
            }
        )
    # at the goal's budget, each comparison a pair run in turns (both meet the machine at the same speed):
    # all in memory, and the two baselines, each against the lookahead tier
    pair = (settings["pair_iterations"], profile["batch"])
    pairs: dict[str, Any] = {}
    comparisons = settings.get("pairs", ["memory", "lru", "next-batch"])
    for other, flags in (
        ("memory", []),
        ("lru", list(_policy("lru", goal))),
        ("next-batch", list(_policy("next-batch", goal))),
    ):
        if other not in comparisons:
            continue
        theirs, ours = interleaved(
            [
                (f"tier-pair-{other}", start + flags),
                (f"tier-pair-{other}-lookahead", start + list(_policy("lookahead", goal))),
            ],
            profile,
            out,
            hold_at=settings["pair_iterations"] // 2,
        )
        pairs[other] = {
            "other": _figures(theirs, out / "runs" / f"tier-pair-{other}", *pair),
            "lookahead": _figures(ours, out / "runs" / f"tier-pair-{other}-lookahead", *pair),
        }
        pairs[other]["lookahead_over_other"] = ours["median_ms"] / theirs["median_ms"]
        log(f"tier: lookahead at the goal / {other}: {pairs[other]['lookahead_over_other']:.3f}x")
    # the same against all in memory behind the limited link (the servers in a network namespace)
    for rate in settings.get("rates", []) if "memory" in comparisons else []:
        with limited_link(rate) as ns:
            if ns is None:
                pairs[f"memory-{rate}"] = {"skipped": "no limited link here (the log says why)"}
                continue
            link = ["--embedding-server-netns", ns, "--netns-addresses", f"{HOST_IP},{NS_IP}"]
            theirs, ours = interleaved(
                [
                    (f"tier-pair-memory-{rate}", start + link),
                    (f"tier-pair-memory-{rate}-lookahead", start + link + list(_policy("lookahead", goal))),
                ],
                profile,
                out,
                hold_at=settings["pair_iterations"] // 2,
            )
            pairs[f"memory-{rate}"] = {
                "other": _figures(theirs, out / "runs" / f"tier-pair-memory-{rate}", *pair),
                "lookahead": _figures(ours, out / "runs" / f"tier-pair-memory-{rate}-lookahead", *pair),
                "lookahead_over_other": ours["median_ms"] / theirs["median_ms"],
            }
            log(
                f"tier: at {rate}, lookahead / memory: {pairs[f'memory-{rate}']['lookahead_over_other']:.3f}x"
            )
    rows = math.ceil(sum(scaled_table_rows(float(scale))) / SERVERS)
    # (without the pairs: the sweep's jobs alone, the whole budget as all in memory)
    alone = {r["fraction"]: r for r in sweep}
    memory = pairs["memory"]["other"] if "memory" in pairs else alone[1.0]
    ours = pairs["memory"]["lookahead"] if "memory" in pairs else alone[settings["goal"]]
    return {
        "scale": scale,
        "iterations": iterations,
        "pair_iterations": settings["pair_iterations"],
        "batch": profile["batch"],
        "servers": SERVERS,
        "shard_bytes": per_server,
        "shard_rows": rows,
        "rows_on_disk_bytes": ours["rows_on_disk"] * per_server / rows,
        "goal": settings["goal"],
        "goal_budget_bytes": goal,
        # what a server holds besides its rows: all in memory, its resident set less its shard's rows
        "fixed_overhead_bytes": memory["resident_bytes"] - per_server,
        "memory": memory,
        "ours": ours,
        "goal_alone_over_full": alone[settings["goal"]]["median_ms"] / alone[1.0]["median_ms"],
        "sweep": sweep,
        "pairs": pairs,
    }


# a profile shard's bookkeeping a row: its memory slot, disk slot, next use, last batch and its place in it,
# flags (34 bytes), and the row file's owner of each slot, up to two slots a row (16)
INDEX_BYTES_PER_ROW = 50


def table(results: dict[str, Any]) -> list[str]:
    if "ours" not in results.get("tier", {}):
        return []
    tier = results["tier"]
    lines = [
        "",
        f"Row tier: scale {tier['scale']}, {tier['servers']} servers of "
        f"{tier['shard_bytes'] / 2**20:.0f} MiB of rows and state each, every row stored, "
        f"{tier['rows_on_disk_bytes'] / 1e9:.2f} GB on disk at the goal's budget.",
        "",
        "Budget swept, each job alone (x: against the 100% budget):",
        "",
        "| --row-memory | ms per iteration | x | rows read | waited for | read ahead unused "
        "| disk bytes written per sample | resident MiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    full = tier["sweep"][0]["median_ms"]
    lines += [
        f"| {100 * r['fraction']:g}% ({r['budget_bytes'] / 2**20:.0f} MiB) | {r['median_ms']:.1f} | "
        f"{r['median_ms'] / full:.2f}x | {r['rows_read']:,.0f} | {r['rows_waited']:,.0f} | "
        f"{r['rows_wasted']:,.0f} | {r['disk_bytes_written_per_sample']:.1f} | "
        f"{r['resident_bytes'] / 2**20:.0f} |"
        for r in tier["sweep"]
    ]
    if not tier["pairs"]:
        return lines
    lines += [
        "",
        f"At {100 * tier['goal']:g}% ({tier['goal_budget_bytes'] / 2**20:.0f} MiB), lookahead against each "
        "in a pair run in turns:",
        "",
        "| against | its ms | lookahead ms | lookahead / it | its fetches' disk wait ms | lookahead's "
        "| its rows waited for | lookahead's | trainers' prefetch wait ms, its / lookahead's "
        "| lookahead resident MiB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for other, pair in tier["pairs"].items():
        if "skipped" in pair:
            lines.append(f"| {other} | skipped: {pair['skipped']} |||||||")
            continue
        them, us = pair["other"], pair["lookahead"]
        lines.append(
            f"| {other} | {them['median_ms']:.1f} | {us['median_ms']:.1f} | "
            f"{pair['lookahead_over_other']:.3f}x | {them['fetch_disk_wait_ms']:.2f} | "
            f"{us['fetch_disk_wait_ms']:.2f} | {them['rows_waited']:,.0f} | {us['rows_waited']:,.0f} | "
            f"{them['prefetch_wait_ms']:.2f} / {us['prefetch_wait_ms']:.2f} | "
            f"{us['resident_bytes'] / 2**20:.0f} |"
        )
    return lines


def targets(results: dict[str, Any]) -> tuple[list[Target], list[str]]:
    if "ours" not in results.get("tier", {}):
        return [], []
    tier = results["tier"]
    pairs = tier["pairs"]
    found: list[Target] = []
    if "memory" not in pairs:  # (each job alone, one after the other)
        ratio = tier["goal_alone_over_full"]
        found.append(("tier: at the goal's budget / all of it, alone", ratio, "<= 1.10", ratio <= 1.10))
    for name, pair in pairs.items():
        if name.startswith("memory") and "skipped" not in pair:
            where = "loopback" if name == "memory" else name.removeprefix("memory-")
            ratio = pair["lookahead_over_other"]
            found.append(
                (f"tier: at the goal's budget / all in memory, {where}", ratio, "<= 1.10", ratio <= 1.10)
            )
    ours = tier["ours"]
    found.append(
        (
            "tier: disk reads / the reads needed",
            ours["reads_over_needed"],
            "<= 1.10",
            ours["reads_over_needed"] <= 1.10,
        )
    )
    # the time fetches waited for rows on disk: at the servers, where the wait happens (the trainers'
    # prefetch wait hides most of it behind the transfer group they fetch ahead, in every policy alike)
    for baseline in (b for b in ("lru", "next-batch") if b in pairs):
        pair = pairs[baseline]
        ratio = pair["other"]["fetch_disk_wait_ms"] / max(pair["lookahead"]["fetch_disk_wait_ms"], 1e-6)
        found.append((f"tier: fetches' disk wait of {baseline} / lookahead's", ratio, ">= 2", ratio >= 2))
    # resident memory: the budget, the per-row index, and what a server holds besides its rows (the
    # in-memory server's resident set less its shard's rows)
    allowed = (
        tier["goal_budget_bytes"] + INDEX_BYTES_PER_ROW * tier["shard_rows"] + tier["fixed_overhead_bytes"]
    )
    found.append(
        (
            "tier: resident / (budget + index + fixed overhead)",
            ours["resident_bytes"] / allowed,
            "<= 1.00",
            ours["resident_bytes"] <= allowed,
        )
    )
    # what the writes mean for an SSD's endurance: each server's bytes a day at the pair's speed, against a
    # 1.92 TB drive rated for 3 to 5 drive writes a day (5.8 to 9.6 TB a day)
    samples_per_s = 1000 * tier["batch"] / ours["median_ms"] if "batch" in tier else None
    per_day = (
        ours["disk_bytes_written_per_sample"] * samples_per_s * 86400 / tier["servers"]
        if samples_per_s
        else None
    )
    notes = [
        f"tier: fixed overhead (an in-memory server's resident set less its rows): "
        f"{tier['fixed_overhead_bytes'] / 2**20:.0f} MiB",
        f"tier: {ours['disk_bytes_written_per_sample']:.0f} disk bytes written per sample"
        + (f", {per_day / 1e12:.1f} TB a day a server at this speed" if per_day else ""),
    ]
    if tier["rows_on_disk_bytes"] < 4e9:
        notes.append(
            f"tier: {tier['rows_on_disk_bytes'] / 1e9:.2f} GB of rows on disk, short of the goal's 4 GB "
            "(the profile's scale; make bench's, the quick profile's, holds more)"
        )
    return found, notes
