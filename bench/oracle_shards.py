"""Oracle shards: what planning by key range costs a shard, measured, and the rate K shards would reach.

The oracle plans every key of every batch on one core (``oracle_throughput.py``: about 6 M samples/s at
8 trainers, 3 M at 64). Each key's decisions (Algorithm 1, LRPP, delayed synchronisation) depend on that
key's accesses alone, apart from the cache's capacity, so K oracle shards could each plan the keys of
their own buckets (the embedding servers' bucket map over K shards), each with its part of the capacity.

For each K, the same batches (synthetic Criteo-Kaggle, the paper's point: batch 16,384, 26 tables, L=200)
are split into K parts as data processors would send them (each shard's keys numbered as a server numbers
its rows), and each shard's work per batch is timed on its own, one shard after another on one core:
its planner's pop and push, its plan part serialised for the trainers, and, for the batches whose samples
it carries (batch % K), the samples' checks. Measured: each shard's seconds. Computed from them: the rate
of K shards on K cores (the slowest shard's time per batch) and the bytes a trainer receives per batch (K
plan parts, its samples once). This is the planner, not a service: ``bagpipe run`` runs one oracle.

    .venv/bin/python bench/oracle_shards.py [--oracles 1,2,4,8,16 --trainers 8,64 --timed 100]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
from bagpipe import allocator  # noqa: E402
from bagpipe.codec import check_samples, encode_batch, encode_plans  # noqa: E402
from bagpipe.core.data import KAGGLE_TABLE_ROWS, SyntheticConfig, SyntheticSource, build_batch, table_offsets  # noqa: E402
from bagpipe.core.plans import MAX_TRAINERS, trainer_users  # noqa: E402
from bagpipe.core.shard_map import ShardMap  # noqa: E402
from bagpipe.oracle_cacher.lookahead import LookaheadPlanner  # noqa: E402


def measure(
    oracles: list[int],
    trainers: list[int],
    batch_size: int = 16384,
    tables: int = 26,
    lookahead: int = 200,
    timed: int = 100,
    zipf_alpha: float = 1.1,
) -> dict[str, Any]:
    """Every K of ``oracles`` at every count of ``trainers`` (those above ``MAX_TRAINERS`` are reported
    refused), over the same batches: ``lookahead`` batches to fill the window, then as many untimed (the
    cache reusing slots, as in the rest of a job), then ``timed``."""
    allocator.keep_freed_buffers()  # as the oracle service does
    rows = KAGGLE_TABLE_ROWS[:tables]
    offsets = table_offsets(rows)
    num_keys = int(offsets[-1])
    source = SyntheticSource(SyntheticConfig(table_rows=rows, zipf_alpha=zipf_alpha))
    total = 2 * lookahead + timed
    t0 = time.perf_counter()
    batches = [build_batch(b, source.batch(b, batch_size), offsets) for b in range(total)]
    generated = time.perf_counter() - t0
    points: list[dict[str, Any]] = []
    for count in trainers:
        if count > MAX_TRAINERS:
            points.append({"trainers": count, "refused": f"at most {MAX_TRAINERS} trainers (MAX_TRAINERS)"})
            continue
        users = [trainer_users(a.inverse, a.keys.size, count) for a in batches]
        samples = [encode_batch(a, b == total - 1, users[b], count)[1:] for b, a in enumerate(batches)]
        for k in oracles:
            point = _shards(batches, users, samples, num_keys, k, count, batch_size, lookahead, timed)
            points.append(point)
            print(
                f"oracle shards: {count} trainers, K={k}: slowest shard {point['slowest_ms_per_batch']:.2f} "
                f"ms/batch (all {point['sum_ms_per_batch']:.2f}): {point['samples_per_second'] / 1e6:.2f} M "
                f"samples/s on {k} core(s); {point['bytes_per_trainer_per_batch'] / 1e6:.2f} MB a trainer "
                "a batch",
                flush=True,
            )
    return {
        "benchmark": "oracle_shards",
        "batch_size": batch_size,
        "tables": tables,
        "total_rows": num_keys,
        "lookahead": lookahead,
        "timed_batches": timed,
        "zipf_alpha": zipf_alpha,
        "batch_generation_seconds_untimed": generated,
        "points": points,
    }


def _shards(
    batches: list[Any],
    users: list[np.ndarray],
    samples: list[list[bytes]],
    num_keys: int,
    oracles: int,
    trainers: int,
    batch_size: int,
    lookahead: int,
    timed: int,
) -> dict[str, Any]:
    """K planners from an empty state, each fed its part of every batch; each shard's work timed alone."""
    total = len(batches)
    shard_map = ShardMap.create(num_keys, oracles)
    layouts = [shard_map.local_layout(s) for s in range(oracles)]

    def part(b: int, shard: int) -> tuple[np.ndarray, np.ndarray]:
        """Batch ``b``'s keys of ``shard`` as a data processor sends them (numbered as the shard's rows,
        sorted) with their trainer masks; with one shard, the batch as it is."""
        keys = batches[b].keys
        if oracles == 1:
            return keys, users[b]
        mine = np.flatnonzero(shard_map.shard_of(keys) == shard)
        local = shard_map.local_rows(keys[mine], layouts[shard][0])
        order = np.argsort(local, kind="stable")
        return local[order], users[b][mine[order]]

    parts = [[part(b, s) for s in range(oracles)] for b in range(total)]  # (the processors' work: untimed)
    planners = [
        LookaheadPlanner(layouts[s][1] if oracles > 1 else num_keys, lookahead, trainers)
        for s in range(oracles)
    ]
    for b in range(lookahead):
        for s, planner in enumerate(planners):
            planner.push(b, parts[b][s][0], users=parts[b][s][1])
    seconds = np.zeros(oracles)
    received = np.zeros(trainers)  # bytes each trainer is sent over the timed batches
    none = [b""] * trainers
    for b in range(lookahead, total):
        x = b - lookahead  # the batch planned now
        timing = x >= lookahead
        for s, planner in enumerate(planners):
            start = time.perf_counter()
            carries = b % oracles == s  # (the samples of batch b travel with one shard)
            if carries:
                for rank, piece in enumerate(samples[b]):
                    check_samples(piece, b, rank, batch_size // trainers)
            plan = planner.pop()
            planner.push(b, parts[b][s][0], last=b == total - 1, users=parts[b][s][1])
            encoded = encode_plans(plan, samples[x] if x % oracles == s else none, batch_size)
            if timing:
                seconds[s] += time.perf_counter() - start
                received += [
                    len(encoded.rows) + len(p) + len(q)
                    for p, q in zip(encoded.samples, encoded.plans, strict=True)
                ]
    slowest = float(seconds.max())
    return {
        "trainers": trainers,
        "oracles": oracles,
        "shard_seconds": seconds.tolist(),
        "slowest_ms_per_batch": 1000 * slowest / timed,
        "sum_ms_per_batch": 1000 * float(seconds.sum()) / timed,
        "samples_per_second": timed * batch_size / slowest,
        "samples_per_second_one_core": timed * batch_size / float(seconds.sum()),
        "bytes_per_trainer_per_batch": float(received.mean()) / timed,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--oracles", default="1,2,4,8,16", help="shard counts, comma-separated")
    p.add_argument("--trainers", default="8,64,256", help="trainer counts, comma-separated")
    p.add_argument("--batch-size", type=int, default=16384)
    p.add_argument("--tables", type=int, default=26, help="the first N Kaggle tables")
    p.add_argument("--lookahead", type=int, default=200)
    p.add_argument("--timed", type=int, default=100, help="batches timed after two windows")
    p.add_argument("--out", default="bench/results/oracle_shards.json")
    a = p.parse_args()
    result = measure(
        [int(k) for k in a.oracles.split(",")],
        [int(t) for t in a.trainers.split(",")],
        a.batch_size,
        a.tables,
        a.lookahead,
        a.timed,
    )
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
