"""Oracle shards (``--oracles K``): what planning by key range costs, measured, and the rates it gives.

Each key's decisions (Algorithm 1, LRPP, delayed synchronisation) depend on that key's accesses alone,
apart from the cache's capacity, so K oracle shards each plan the keys of their own buckets
(``core/oracle_shards.py``). The same batches (synthetic Criteo-Kaggle, the paper's point: batch 16,384,
26 tables, L=200) are cut as the data processors cut them for K shards (``oracle_part``: each shard's keys
as its local rows, with their trainer masks; the trainers' samples from the shard that carries the batch)
and serialised as they send them, untimed. A shard's work per batch is what its service does, end to
end: its part read and checked as it arrives (``decode_batch``) and the samples' checks for the batches
it carries (batch % K), its planner's pop (its plan written in the trainers' terms: ``LookaheadPlanner``'s
``shard``) and push, its plan serialised for every trainer (``codec.encode_plans``, the rows without
masks, as with LRPP). gRPC's own sending and receiving is not in it.

* **Measured, K processes at once** (``--concurrent``, 8 trainers): K shards, each a process of its own
  pinned to a core of its own, start the timed batches together; the rate is the batches' samples over
  the slowest shard's time. K=1 on one core against K=2 on this machine's two is the section's goal.
* **Measured, one shard at a time** (``--oracles``, ``--trainers``): each shard's time a batch, one after
  another on one core. **Computed** from it: the rate of K shards on K cores (the slowest shard's time a
  batch), for K and trainer counts beyond this machine's cores.
* **Measured, a trainer's side**: one trainer's receipt of a batch's K plan parts from their bytes, as
  its plan streams yield them (``codec.plan_part``: the plans and samples parsed, the rows read from their
  bytes), merged and cut into its share (``codec.decode_plans``), a batch at a time; and the bytes it
  receives a batch (K plan parts, its samples once).

    .venv/bin/python bench/oracle_shards.py [--oracles 1,2,4,8,16 --trainers 8,64,256 --concurrent 1,2]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
from bagpipe import allocator  # noqa: E402
from bagpipe.codec import (  # noqa: E402
    check_samples,
    decode_batch,
    decode_plans,
    encode_batch,
    encode_plans,
    plan_part,
)
from bagpipe.core.data import KAGGLE_TABLE_ROWS, SyntheticConfig, SyntheticSource, build_batch, table_offsets  # noqa: E402
from bagpipe.core.oracle_shards import KeyShards  # noqa: E402
from bagpipe.core.plans import MAX_TRAINERS, trainer_users  # noqa: E402
from bagpipe.data_processor.server import oracle_part  # noqa: E402
from bagpipe.oracle_cacher.lookahead import LookaheadPlanner  # noqa: E402
from bagpipe.v1 import data_processor_pb2 as dpb  # noqa: E402

TARGET_SPEEDUP = 1.8  # K=2 on two cores against K=1 on one, 8 trainers
TARGET_TRAINER_MS = 1.0  # a trainer's receipt and merge of K=8 parts, a batch

# (the forked shards' inputs: set before forking, read by the children as the parent left them)
_SHARED: dict[str, Any] = {}


def measure(
    oracles: list[int],
    trainers: list[int],
    concurrent: list[int],
    batch_size: int = 16384,
    tables: int = 26,
    lookahead: int = 200,
    timed: int = 100,
    concurrent_timed: int = 200,
    repeats: int = 5,
    zipf_alpha: float = 1.1,
) -> dict[str, Any]:
    """Every K of ``oracles`` at every count of ``trainers`` one shard at a time, and every K of
    ``concurrent`` at 8 trainers with its shards at once, over the same batches: ``lookahead`` batches to
    fill the window, then as many untimed (the cache reusing slots, as in the rest of a job), then the
    timed ones."""
    allocator.keep_freed_buffers()  # as the oracle service does
    rows = KAGGLE_TABLE_ROWS[:tables]
    offsets = table_offsets(rows)
    num_keys = int(offsets[-1])
    source = SyntheticSource(SyntheticConfig(table_rows=rows, zipf_alpha=zipf_alpha))
    total = 2 * lookahead + max(timed, concurrent_timed if concurrent else 0)
    t0 = time.perf_counter()
    batches = [build_batch(b, source.batch(b, batch_size), offsets) for b in range(total)]
    generated = time.perf_counter() - t0
    points: list[dict[str, Any]] = []
    together: list[dict[str, Any]] = []
    for count in trainers:
        if count > MAX_TRAINERS:
            points.append({"trainers": count, "refused": f"at most {MAX_TRAINERS} trainers (MAX_TRAINERS)"})
            continue
        users = [trainer_users(a.inverse, a.keys.size, count) for a in batches]
        for k in oracles:
            inputs = _inputs(batches, users, num_keys, k, count, batch_size, lookahead)
            point = _in_child(_one_at_a_time, inputs, timed)
            points.append(point)
            print(
                f"oracle shards: {count} trainers, K={k}: slowest shard {point['slowest_ms_per_batch']:.2f} "
                f"ms/batch (all {point['sum_ms_per_batch']:.2f}): {point['samples_per_second'] / 1e6:.2f} M "
                f"samples/s on {k} core(s), computed; a trainer receives "
                f"{point['bytes_per_trainer_per_batch'] / 1e6:.3f} MB a batch and merges it in "
                f"{point['trainer_ms_per_batch']:.3f} ms",
                flush=True,
            )
        if count == 8 and concurrent:
            each = [_inputs(batches, users, num_keys, k, count, batch_size, lookahead) for k in concurrent]
            for point in _at_once(each, concurrent_timed, repeats):
                together.append(point)
                k = point["oracles"]
                runs = ", ".join(f"{r / 1e6:.2f}" for r in point["runs"])
                print(
                    f"oracle shards at once: 8 trainers, K={k} on {k} core(s): "
                    f"{point['samples_per_second'] / 1e6:.2f} M samples/s measured (the best of {runs})",
                    flush=True,
                )
    result: dict[str, Any] = {
        "benchmark": "oracle_shards",
        "batch_size": batch_size,
        "tables": tables,
        "total_rows": num_keys,
        "lookahead": lookahead,
        "timed_batches": timed,
        "concurrent_timed_batches": concurrent_timed,
        "zipf_alpha": zipf_alpha,
        "cores": len(os.sched_getaffinity(0)),
        "batch_generation_seconds_untimed": generated,
        "points": points,
        "concurrent": together,
    }
    rates = {p["oracles"]: p["samples_per_second"] for p in together}
    if 1 in rates and 2 in rates:
        result["speedup_2_over_1"] = rates[2] / rates[1]
        result["speedup_target"] = TARGET_SPEEDUP
        print(f"K=2 on 2 cores / K=1 on 1: {result['speedup_2_over_1']:.2f}x (goal >= {TARGET_SPEEDUP})")
    return result


def _inputs(
    batches: list[Any],
    users: list[np.ndarray],
    num_keys: int,
    oracles: int,
    trainers: int,
    batch_size: int,
    lookahead: int,
) -> dict[str, Any]:
    """Every batch as the data processors send it to K shards (untimed): each shard's part
    (``oracle_part``: its keys as its local rows, sorted, with their masks) as the ``BatchPart`` bytes of a
    StreamBatches call that asked for samples in per-trainer slices, and the trainers' ``Samples`` parts
    from the shard that carries the batch (batch % K; their inverse indexes the keys in shard order)."""
    shards = KeyShards(num_keys, oracles) if oracles > 1 else None
    heads: list[list[bytes]] = []  # [batch][shard]
    samples: list[list[bytes]] = []  # [batch]: every trainer's, from the carrying shard
    for b, arrays in enumerate(batches):
        row = []
        for shard in range(oracles):
            part, its_users, carries = (
                (arrays, users[b], True) if shards is None else oracle_part(arrays, users[b], shards, shard)
            )
            encoded = encode_batch(part, b == len(batches) - 1, its_users, trainers, carries)
            row.append(encoded[0])
            if carries:
                samples.append(encoded[1:])
        heads.append(row)
    return {
        "shards": shards,
        "oracles": oracles,
        "trainers": trainers,
        "batch_size": batch_size,
        "lookahead": lookahead,
        "num_keys": num_keys,
        "tables": batches[0].inverse.shape[1],
        "dense": batches[0].dense.shape[1],
        "heads": heads,
        "samples": samples,
    }


class _Shard:
    """One oracle shard's planner and its work on a batch, as its service does it."""

    def __init__(self, inputs: dict[str, Any], shard: int) -> None:
        self.inputs, self.shard = inputs, shard
        shards = inputs["shards"]
        self.rows = shards.rows(shard) if shards is not None else inputs["num_keys"]
        its = None if shards is None else (shards, shard)  # (a shard's plans: in the trainers' terms)
        self.planner = LookaheadPlanner(self.rows, inputs["lookahead"], inputs["trainers"], shard=its)
        for b in range(inputs["lookahead"]):
            keys, users = self.receive(b)
            self.planner.push(b, keys, users=users)

    def receive(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """Batch ``b``'s part read as the service reads it from a data processor's stream: the ``Batch``
        parsed and checked (``decode_batch``: keys sorted, unique and in range, masks naming trainers of the
        job; the masks come in the planner's width), and the trainers' samples checked if it carries them."""
        i = self.inputs
        trainers, size = i["trainers"], i["batch_size"]
        part = dpb.BatchPart.FromString(i["heads"][b][self.shard])
        wire = decode_batch(
            part.batch,
            num_keys=self.rows,
            batch_size=size,
            num_tables=i["tables"],
            trainers=trainers,
            slices=trainers,
        )
        if b % i["oracles"] == self.shard:
            for rank, piece in enumerate(i["samples"][b]):
                check_samples(piece, b, rank, size // trainers)
        assert wire.users is not None
        return wire.keys, wire.users

    def step(self, b: int) -> Any:
        """Batch ``b`` arrives (``receive``), batch ``b - L`` is planned and its messages serialised;
        returns them."""
        i, planner = self.inputs, self.planner
        k, trainers = i["oracles"], i["trainers"]
        keys, users = self.receive(b)
        plan = planner.pop()
        planner.push(b, keys, last=b == len(i["heads"]) - 1, users=users)
        x = plan.batch
        carried = i["samples"][x] if x % k == self.shard else []
        return encode_plans(plan, carried, i["batch_size"], None, trainers, users=False)


def _one_at_a_time(inputs: dict[str, Any], timed: int) -> dict[str, Any]:
    """K shards from an empty state, each fed its part of every batch; each shard's work timed alone, and
    one trainer's receipt and merge of each batch's parts."""
    k, trainers, lookahead = inputs["oracles"], inputs["trainers"], inputs["lookahead"]
    shards = [_Shard(inputs, s) for s in range(k)]
    seconds = np.zeros(k)
    received = 0
    merge: list[float] = []
    end = 2 * lookahead + timed
    for b in range(lookahead, end):
        timing = b - lookahead >= lookahead
        encoded = []
        for s, shard in enumerate(shards):
            start = time.perf_counter()
            encoded.append(shard.step(b))
            if timing:
                seconds[s] += time.perf_counter() - start
        if not timing:
            continue
        x = b - lookahead
        samples = inputs["samples"][x][0]
        received += sum(len(e.rows) + len(e.plans[0]) for e in encoded) + len(samples)
        start = time.perf_counter()  # a trainer: the parts' messages from their bytes, merged and cut
        parts = [(plan_part(e.plans[0], "plan")[1], plan_part(e.rows, "rows")[1]) for e in encoded]
        got = plan_part(samples, "samples")[1]
        decode_plans(parts, got, inputs["tables"], inputs["dense"], 0, trainers)
        merge.append(time.perf_counter() - start)
    slowest = float(seconds.max())
    batch_size = inputs["batch_size"]
    return {
        "trainers": trainers,
        "oracles": k,
        "shard_seconds": seconds.tolist(),
        "slowest_ms_per_batch": 1000 * slowest / timed,
        "sum_ms_per_batch": 1000 * float(seconds.sum()) / timed,
        "samples_per_second": timed * batch_size / slowest,
        "samples_per_second_one_core": timed * batch_size / float(seconds.sum()),
        "bytes_per_trainer_per_batch": received / timed,
        "trainer_ms_per_batch": 1000 * statistics.median(merge),
        "trainer_p90_ms_per_batch": 1000 * sorted(merge)[int(0.9 * len(merge))],
    }


def _in_child(work: Any, inputs: dict[str, Any], *args: Any) -> Any:
    """``work(inputs, *args)`` in a process of its own, forked (it reads the batches as the parent made
    them): its planners' memory is its own, as each of ``oracle_throughput.py``'s points is, so a point's
    figures do not depend on the heap the points before it left."""
    _SHARED["inputs"] = inputs
    context = multiprocessing.get_context("fork")
    out = context.Queue()
    child = context.Process(target=_child, args=(work, args, out))
    child.start()
    result = out.get()
    child.join()
    if child.exitcode != 0 or isinstance(result, BaseException):
        raise RuntimeError(f"a measuring process failed ({child.exitcode})") from (
            result if isinstance(result, BaseException) else None
        )
    return result


def _child(work: Any, args: tuple[Any, ...], out: Any) -> None:
    try:
        out.put(work(_SHARED["inputs"], *args))
    except BaseException as e:  # (reported to the parent, which raises it)
        out.put(RuntimeError(repr(e)))
        raise


def _shard_process(shard: int, timed: int, barrier: Any, out: Any) -> None:
    """One shard in a process of its own, pinned to a core: fills its window, waits for the others, then
    times its timed batches."""
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[shard % len(cores)]})
    inputs = _SHARED["inputs"]
    lookahead = inputs["lookahead"]
    worker = _Shard(inputs, shard)
    for b in range(lookahead, 2 * lookahead):  # untimed: the cache reusing slots, as in the rest of a job
        worker.step(b)
    barrier.wait()
    start = time.perf_counter()
    for b in range(2 * lookahead, 2 * lookahead + timed):
        worker.step(b)
    out.put((shard, time.perf_counter() - start))


def _at_once(each: list[dict[str, Any]], timed: int, repeats: int) -> list[dict[str, Any]]:
    """For each K of ``each`` (one ``_inputs`` a K), K shard processes at once, each on a core of its own;
    the best of ``repeats`` runs. The Ks take turns, run by run, so that a slow spell of this shared
    machine (``oracle_throughput.py``'s docstring) falls on each alike rather than on one K's runs."""
    context = multiprocessing.get_context("fork")  # (the children read the batches as the parent made them)
    runs: list[list[float]] = [[] for _ in each]
    shard_seconds: list[list[list[float]]] = [[] for _ in each]
    for _ in range(repeats):
        for i, inputs in enumerate(each):
            k = inputs["oracles"]
            _SHARED["inputs"] = inputs
            barrier, out = context.Barrier(k), context.Queue()
            children = [
                context.Process(target=_shard_process, args=(s, timed, barrier, out)) for s in range(k)
            ]
            for child in children:
                child.start()
            times = dict(out.get() for _ in range(k))
            for child in children:
                child.join()
                if child.exitcode != 0:
                    raise RuntimeError(f"a shard process ended with {child.exitcode}")
            runs[i].append(timed * inputs["batch_size"] / max(times.values()))
            shard_seconds[i].append([times[s] for s in range(k)])
    points = []
    for i, inputs in enumerate(each):
        best = int(np.argmax(runs[i]))
        points.append(
            {
                "trainers": inputs["trainers"],
                "oracles": inputs["oracles"],
                "cores": inputs["oracles"],
                "samples_per_second": runs[i][best],
                "shard_seconds": shard_seconds[i][best],
                "runs": runs[i],
            }
        )
    return points


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--oracles", default="1,2,4,8,16", help="shard counts one at a time, comma-separated")
    p.add_argument("--trainers", default="8,64,256", help="trainer counts, comma-separated")
    p.add_argument(
        "--concurrent",
        default="1,2",
        help="shard counts measured at once, a process a core, 8 trainers (empty: none)",
    )
    p.add_argument("--batch-size", type=int, default=16384)
    p.add_argument("--tables", type=int, default=26, help="the first N Kaggle tables")
    p.add_argument("--lookahead", type=int, default=200)
    p.add_argument("--timed", type=int, default=100, help="batches timed after two windows, one at a time")
    p.add_argument("--concurrent-timed", type=int, default=200, help="... at once")
    p.add_argument(
        "--repeats", type=int, default=5, help="runs at once of each K, in turns; the best is reported"
    )
    p.add_argument("--out", default="bench/results/oracle_shards.json")
    a = p.parse_args()
    result = measure(
        [int(k) for k in a.oracles.split(",")],
        [int(t) for t in a.trainers.split(",")],
        [int(k) for k in a.concurrent.split(",") if k],
        a.batch_size,
        a.tables,
        a.lookahead,
        a.timed,
        a.concurrent_timed,
        a.repeats,
    )
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
