"""Two jobs alive at once and run in turns, each frozen while the other runs, and the iterations of
each that count: those wholly inside its own slices, once both are warm."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bagpipe.local.keeper import children_matching, process_cpu_seconds

from suite.common import log
from suite.jobs import job_argv, job_result, trainer_rows

# a job runs alone for a slice of at least this long, or, if longer, of SLICE_ITERATIONS times the median
# iteration of the slower job while both ran at once (about twice as many iterations alone). With slices
# of 0.5 s, bagpipe's iterations stayed 4-12% slower than the ideal's for the first eight after a thaw and
# bagpipe/ideal came out at 1.07x at 1 Gbit/s (three pairs: 1.06-1.08x); with 2 s slices, 1.02x (pairs
# 0.99-1.05x): a thaw costs bagpipe more than the ideal, likely its gRPC connections restarting from TCP's
# initial window after an idle spell (net.ipv4.tcp_slow_start_after_idle), so slices are long
SLICE_S = 2.0
SLICE_ITERATIONS = 10
# each job's first iterations (an eighth, and at least HELD_AT), run at once by both, are not measured:
# bagpipe's first 30-40 at the quick profile ran at up to twice the time of the rest, while its data
# processors and oracle filled the lookahead window
HELD_AT = 10
# nor those until its data processors have built every batch: they build all of a 400-iteration job's
# batches (3.1-3.4 s of CPU) in its first 60-75 iterations, and how much of that work reaches a job's
# window depends on how soon its trainers start (alone, the ideal's a second after bagpipe's), so each is held
# only once its data processors' CPU has not moved for DATA_QUIET_S (or it is halfway through)
DATA_QUIET_S = 1.0
# nor the first iterations of each slice: right after a thaw they took 1.2-1.6x as long (caches and
# pages the other job had used), the third and later ones as long as the rest
SETTLE = 2
# a job held (frozen) until the other one has started runs on for a moment this often: its launcher's
# failure detector (frozen with it) then sees progress, and never a trainer silent for its 10 s
HOLD_THAW_EVERY_S, HOLD_THAW_S = 3.0, 0.2


def iterations_done(run_dir: Path, trainers: int = 2) -> int:
    """How many iterations every trainer has logged (0 before they all log)."""
    paths = sorted((run_dir / "metrics").glob("trainer-*.csv"))
    if len(paths) < trainers:
        return 0
    return min(max(0, p.read_bytes().count(b"\n") - 1) for p in paths)


SERVICE_MODULES = {
    "trainer": "bagpipe.trainer",
    "embedding-server": "bagpipe.embedding_server",
    "data-processor": "bagpipe.data_processor",
    "oracle-cacher": "bagpipe.oracle_cacher",
}


def service_cpu(launcher: int) -> dict[str, float]:
    """CPU seconds each kind of service of a job (children of its launcher, ``launcher``) has used so
    far, summed as the launcher's summary sums them (``cpu_seconds_at_end``)."""
    return {
        kind: sum(process_cpu_seconds(pid) or 0.0 for pid in children_matching(module, launcher))
        for kind, module in SERVICE_MODULES.items()
    }


def cpu_ms_since(
    at_hold: dict[str, float], summary: dict[str, Any], iterations_since: int
) -> dict[str, float] | None:
    """Each kind of service's CPU ms an iteration from when a job was held (``at_hold``) to its end
    (the summary's ``cpu_seconds_at_end``), over the ``iterations_since`` it ran in between; None when
    either reading is missing (then the summary's whole-job figure stands)."""
    at_end = summary.get("cpu_seconds_at_end")
    if not at_end or not at_hold or iterations_since < 1:
        return None
    return {k: 1000 * (at_end[k] - at_hold.get(k, 0.0)) / iterations_since for k in at_end}


class Quiet:
    """Whether a job's data processors are done: their CPU has not moved for ``DATA_QUIET_S``. Called
    every poll while the job starts; finds them (children of its launcher, ``launcher``) once they exist."""

    def __init__(self, launcher: int) -> None:
        self.launcher = launcher
        self.pids: list[int] = []
        self.looked = -math.inf
        self.cpu = 0.0
        self.since = time.monotonic()

    def __call__(self) -> bool:
        now = time.monotonic()
        if not self.pids and now - self.looked >= 0.5:
            self.looked = now
            self.pids = children_matching("bagpipe.data_processor", self.launcher)
        cpu = sum(process_cpu_seconds(pid) or 0.0 for pid in self.pids)
        if cpu != self.cpu:
            self.cpu, self.since = cpu, now
        return cpu > 0 and now - self.since >= DATA_QUIET_S


def in_slices(
    logs: list[list[dict[str, str]]], slices: list[tuple[float, float]], skip: int
) -> tuple[list[int], list[float], dict[str, float]]:
    """The iterations after the first ``skip`` that every trainer ran wholly inside one of ``slices``
    (wall-clock intervals in which its job ran alone), less the first ``SETTLE`` of each slice: their
    batches, their times (the slowest trainer's: training is synchronous) and the mean of each stage over
    them and the trainers. An iteration that spans a freeze is left out, so no frozen time counts."""
    batches: list[int] = []
    seconds: list[float] = []
    stages: dict[str, list[float]] = {}
    seen = [0] * len(slices)  # iterations so far inside each slice
    for n, per_trainer in enumerate(zip(*logs, strict=False)):
        start = min(float(r["time"]) - float(r["iteration_seconds"]) for r in per_trainer)
        end = max(float(r["time"]) for r in per_trainer)
        inside = next((k for k, (a, b) in enumerate(slices) if a <= start and end <= b), None)
        if inside is None:
            continue
        seen[inside] += 1
        if n < skip or seen[inside] <= SETTLE:
            continue
        batches.append(int(per_trainer[0]["batch"]))
        seconds.append(max(float(r["iteration_seconds"]) for r in per_trainer))
        for r in per_trainer:
            for key, value in r.items():
                if key.endswith("_seconds") and key != "iteration_seconds":
                    stages.setdefault(key.removesuffix("_seconds"), []).append(float(value))
    return batches, seconds, {k: statistics.fmean(v) for k, v in stages.items()}


def interleaved(
    pair: list[tuple[str, list[str]]], profile: dict[str, Any], out: Path, hold_at: int | None = None
) -> list[dict[str, Any]]:
    """Two jobs (name, flags) alive at once and run in turns: each job's processes are frozen
    (``SIGSTOP`` to its process group) while the other's run, for slices of ``SLICE_S`` or more. The
    machine's speed on these shared cores moves by a quarter from one minute to the next, and by a tenth
    within seconds; two jobs run one after the other meet different speeds, two run in turns the same.
    Only iterations wholly inside their own job's slices count, from when both jobs are past their
    first eighth and their data processors have built every batch (the one there first is held, frozen,
    for the other) until either ends. With ``hold_at`` each is held at that iteration instead, so both are
    measured from the same point (a row tier's first pass over its rows on disk is not its steady state).
    Returns each job's figures as ``job`` does, its stages measured over the same iterations."""
    procs: list[subprocess.Popen[bytes]] = []
    run_dirs = [out / "runs" / name for name, _ in pair]
    outputs = []
    t0 = time.perf_counter()
    done = False
    iterations = profile["pair_iterations"]
    warm = max(HELD_AT, iterations // 8)
    try:
        for (name, flags), run_dir in zip(pair, run_dirs, strict=True):
            argv = job_argv(name, profile, out, *flags, iterations=iterations)
            run_dir.mkdir(parents=True)
            outputs.append(open(run_dir.parent / f"{name}.log", "wb"))  # noqa: SIM115
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "bagpipe.cli", *argv],
                    stdout=outputs[-1],
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # (its own process group: the launcher and every service)
                )
            )

        def check() -> bool:
            """True while both run; raises when one of them failed."""
            for (name, _), p in zip(pair, procs, strict=True):
                if p.poll() not in (None, 0):
                    raise RuntimeError(f"{name} failed (exit {p.returncode}): see {out / 'runs' / name}.log")
            return all(p.poll() is None for p in procs)

        held: dict[int, float] = {}
        measured_from = [warm, warm]  # the iteration each job was held at: its measured ones follow
        cpu_at_hold: list[dict[str, float]] = [{}, {}]  # its services' CPU then
        quiet = [Quiet(p.pid) for p in procs]
        while len(held) < 2 and check():
            for i, run_dir in enumerate(run_dirs):
                if i not in held:
                    ready = quiet[i]()  # (every poll: it times the processors' last work)
                    logged = iterations_done(run_dir)
                    at_warm = logged >= warm and (ready or logged >= iterations // 2)
                    if (logged >= hold_at) if hold_at is not None else at_warm:
                        os.killpg(procs[i].pid, signal.SIGSTOP)
                        held[i] = time.monotonic()
                        measured_from[i] = iterations_done(run_dir)  # (frozen: no more will come)
                        cpu_at_hold[i] = service_cpu(procs[i].pid)
                elif len(held) < 2 and time.monotonic() - held[i] > HOLD_THAW_EVERY_S:
                    os.killpg(procs[i].pid, signal.SIGCONT)
                    time.sleep(HOLD_THAW_S)
                    os.killpg(procs[i].pid, signal.SIGSTOP)
                    held[i] = time.monotonic()
            time.sleep(0.05)
        so_far = [
            statistics.median(
                float(r["iteration_seconds"]) for rows in trainer_rows(d) for r in rows[warm // 2 : warm]
            )
            for d in run_dirs
        ]
        slice_s = max(SLICE_S, SLICE_ITERATIONS * max(so_far))
        slices: list[list[tuple[float, float]]] = [[], []]
        turn = 0
        while check():
            os.killpg(procs[turn].pid, signal.SIGCONT)
            start = time.time()
            time.sleep(slice_s)
            os.killpg(procs[turn].pid, signal.SIGSTOP)
            slices[turn].append((start, time.time()))
            turn = 1 - turn
        done = True
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGCONT)
                if not done:  # (the harness stopped, or the other job failed)
                    os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            p.wait()
        for f in outputs:
            f.close()
    check()
    wall = time.perf_counter() - t0
    results = []
    for (name, flags), run_dir, own, skip, cpu_then in zip(
        pair, run_dirs, slices, measured_from, cpu_at_hold, strict=True
    ):
        batches, seconds, stages = in_slices(trainer_rows(run_dir), own, skip)
        if not seconds:
            raise RuntimeError(
                f"{name}: no iteration ran wholly inside its slices ({len(own)} of {slice_s} s)"
            )
        summary = json.loads((run_dir / "summary.json").read_text())
        result = job_result(name, flags, iterations, summary, batches, seconds, stages)
        result.update(wall_s=wall, slices=len(own), slice_s=slice_s, measured_from=skip)
        # CPU over the same span as the timings (from the hold on), not from the job's first iteration:
        # the data processors' start-up work falls before it in both systems alike
        since_hold = cpu_ms_since(cpu_then, summary, summary["iterations"] - skip)
        if since_hold is not None:
            result["cpu_ms_whole_job"], result["cpu_ms"] = result["cpu_ms"], since_hold
        result["measured_iterations"] = len(seconds)
        log(
            f"{name}: median {result['median_ms']:.1f} ms over {len(seconds)} iterations from the "
            f"{skip}th in {len(own)} slices of {slice_s:.2f} s, p90 {result['p90_ms']:.1f} ms "
            f"({wall:.0f} s for the pair)"
        )
        results.append(result)
    return results
