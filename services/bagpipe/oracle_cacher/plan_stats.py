"""``bagpipe plan-stats``: what the cache plans cost, without trainers (paper §3.3, Figures 7 and 8).

Runs the data processor's batch generator and the oracle's planner in one process over a data source
for any number of *logical* trainers, and reports per iteration: unique rows, rows prefetched (summed
over trainers), rows synchronised on the critical path and in the background, and bytes — for a
replicated cache, for LRPP, and for LRPP with delayed synchronisation. LRPP with and without delayed
synchronisation share one planner (delaying changes when rows are synchronised, not what is cached).

Averages cover the first ``--iterations`` batches; the planner reads ``L-1`` more so that every
measured batch was planned with a full window.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bagpipe.core.data import table_offsets
from bagpipe.core.optim import OptimizerConfig
from bagpipe.core.oracle_shards import KeyShards, shard_capacity
from bagpipe.core.plans import every_trainer, traffic, trainer_users
from bagpipe.data_processor.batches import numbered_batches
from bagpipe.data_processor.config import source_of
from bagpipe.oracle_cacher.lookahead import LookaheadPlanner

MODES = ("replicated", "lrpp", "lrpp+delayed")


_Part = tuple[int, np.ndarray, np.ndarray, bool]  # a batch's keys of one shard: (number, keys, users, last)


@dataclass
class _Totals:
    batches: int = 0
    sums: dict[str, int] = field(default_factory=dict)

    def add(self, figures: dict[str, int]) -> None:
        self.batches += 1
        for k, v in figures.items():
            self.sums[k] = self.sums.get(k, 0) + v

    def per_iteration(self) -> dict[str, float]:
        return {k: v / max(1, self.batches) for k, v in self.sums.items()}


def plan_stats(args: argparse.Namespace) -> dict[str, Any]:
    """Plans ``args.iterations`` batches three ways and returns the per-iteration figures. With
    ``args.oracles`` K > 1, each way by K planners, one per oracle shard, each given its keys of every batch
    (the embedding servers' bucket map over K shards) and its part of the capacity; each planner is timed
    alone, so the slowest shard's time is what K shards on K cores would take."""
    if args.batch_size % args.trainers:
        raise SystemExit(f"--batch-size: {args.batch_size} does not split over {args.trainers} trainers")
    oracles = args.oracles
    if oracles < 1:
        raise SystemExit(f"--oracles: must be >= 1, got {oracles}")
    source = source_of(args)
    num_keys = int(table_offsets(source.table_rows)[-1])
    shards = KeyShards(num_keys, oracles)
    lookahead = args.lookahead or args.max_lookahead
    width = OptimizerConfig(args.optimizer).state_width(args.embedding_dim)
    # each shard plans its own rows (core/oracle_shards.py): its planner's records are its keys' alone
    planners = {
        name: [
            LookaheadPlanner(
                shards.rows(shard),
                lookahead,
                args.trainers,
                shard_capacity(args.cache_rows, oracles, shard),
                args.reuse_delay,
                name == "lrpp",
            )
            for shard in range(oracles)
        ]
        for name in ("replicated", "lrpp")
    }
    totals = {mode: _Totals() for mode in MODES}
    windows: dict[str, list[int]] = {name: [] for name in planners}
    waiting = {name: [deque[_Part]() for _ in range(oracles)] for name in planners}
    measured = args.iterations
    shard_seconds = np.zeros(oracles)
    shard_unique = np.zeros(oracles, dtype=np.int64)
    started = time.perf_counter()
    for arrays, last in numbered_batches(
        source.open(), source.table_rows, args.batch_size, 0, 1, measured + lookahead - 1
    ):
        users = trainer_users(arrays.inverse, arrays.keys.size, args.trainers)
        split = shards.split(arrays.keys)
        for shard in range(oracles):
            mine = split.part(shard)  # (by local row: the planner takes a batch's keys sorted)
            keys, its_users = split.local[mine], users[mine]
            if arrays.number < measured:
                shard_unique[shard] += keys.size
            t0 = time.perf_counter()
            for name, planner in ((n, planners[n][shard]) for n in planners):
                replicated = name == "replicated"
                queue = waiting[name][shard]
                used_by = every_trainer(keys.size, args.trainers) if replicated else its_users
                queue.append((arrays.number, keys, used_by, last))
                while True:
                    while queue and planner.wants_more():
                        number, k, u, is_last = queue[0]
                        if not planner.push(number, k, last=is_last, users=u):
                            break
                        queue.popleft()
                    if not planner.can_pop():
                        break
                    plan = planner.pop()
                    if plan.batch >= measured:
                        continue
                    windows[name].append(plan.window)
                    totals[name].add(traffic(plan, args.embedding_dim, width, delayed=False).as_dict())
                    if not replicated:
                        totals["lrpp+delayed"].add(
                            traffic(plan, args.embedding_dim, width, delayed=True).as_dict()
                        )
            shard_seconds[shard] += time.perf_counter() - t0
    elapsed = time.perf_counter() - started
    for mode in MODES:  # (K parts a batch: the figures of the batch are their sums)
        totals[mode].batches //= oracles
    result: dict[str, Any] = {
        "data": args.data,
        "scale": args.scale,
        "total_rows": int(num_keys),
        "batch_size": args.batch_size,
        "trainers": args.trainers,
        "oracles": oracles,
        "lookahead": lookahead,
        "cache_rows": args.cache_rows,
        "embedding_dim": args.embedding_dim,
        "optimizer": args.optimizer,
        "iterations": totals["lrpp"].batches,
        "seconds": elapsed,
        "planning_seconds": float(shard_seconds.sum()),
        # each shard's planning (both planners of the three designs), measured alone: K shards on K cores
        # take the slowest one's time
        "shards": [
            {"planning_seconds": float(t), "unique_per_iteration": float(u) / max(1, measured)}
            for t, u in zip(shard_seconds, shard_unique, strict=True)
        ],
        "slowest_shard_seconds": float(shard_seconds.max()),
        "modes": {},
    }
    for mode in MODES:
        name = "replicated" if mode == "replicated" else "lrpp"
        figures = totals[mode].per_iteration()
        # (with shards, the sums of theirs: each shard's peak may come at another batch)
        figures["peak_occupancy_rows"] = sum(p.peak_occupancy for p in planners[name])
        figures["slot_high_water"] = sum(p.slot_high_water for p in planners[name])
        figures["lookahead_min"] = min(windows[name], default=0)
        result["modes"][mode] = figures
    base = result["modes"]["replicated"]
    for mode in MODES:
        m = result["modes"][mode]
        m["critical_rows_vs_replicated"] = (
            1 - m["critical_rows"] / base["critical_rows"] if base["critical_rows"] else 0.0
        )
        m["critical_bytes_vs_replicated"] = (
            1 - m["critical_bytes"] / base["critical_bytes"] if base["critical_bytes"] else 0.0
        )
    return result


def format_stats(r: dict[str, Any]) -> str:
    lines = [
        f"plan statistics: {r['data']} (scale {r['scale']}, {r['total_rows']:,} rows), batch "
        f"{r['batch_size']:,}, "
        f"{r['trainers']} logical trainers, L={r['lookahead']}, {r['iterations']} iterations "
        f"({r['seconds']:.1f} s, planning {r['planning_seconds']:.1f} s"
        + (
            f"; {r['oracles']} oracle shards, the slowest {r['slowest_shard_seconds']:.1f} s)"
            if r["oracles"] > 1
            else ")"
        ),
        "per iteration            unique   prefetched  critical rows  background rows  critical MB  "
        "background MB  "
        "critical rows saved",
    ]
    for mode, m in r["modes"].items():
        lines.append(
            f"  {mode:<20} {m['unique']:>9,.0f} {m['prefetched']:>12,.0f} {m['critical_rows']:>14,.0f} "
            f"{m['background_rows']:>16,.0f} {m['critical_bytes'] / 1e6:>12.2f} "
            f"{m['background_bytes'] / 1e6:>14.2f} "
            f"{100 * m['critical_rows_vs_replicated']:>19.1f}%"
        )
    return "\n".join(lines)


def main(args: argparse.Namespace) -> None:
    result = plan_stats(args)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2) if args.json else format_stats(result))
