"""The benchmark's measurement of two jobs run in turns (bench/suite/interleave.py, ``in_slices``): only the
iterations a job ran wholly inside its own slices count, less the first ones of each slice."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from suite import interleave  # noqa: E402


def trainer_log(ends: list[float], seconds: float, forward: float) -> list[dict[str, str]]:
    return [
        {
            "batch": str(b),
            "time": str(end),
            "iteration_seconds": str(seconds),
            "forward_seconds": str(forward),
            "loss": "0.5",
        }
        for b, end in enumerate(ends)
    ]


def test_counts_only_whole_iterations_inside_slices_after_each_slice_settles() -> None:
    # iterations of 0.1 s ending at 1.15, 1.25, ...; the job ran alone in [1.0, 2.0] and [3.0, 4.0], which
    # hold iterations 0-8 and 20-28 whole
    ends = [1.15 + 0.1 * i for i in range(35)]
    logs = [trainer_log(ends, 0.1, 0.04), trainer_log(ends, 0.1, 0.06)]
    slices = [(1.0, 2.0), (3.0, 4.0)]
    batches, seconds, stages = interleave.in_slices(logs, slices, skip=0)
    assert batches == [*range(9)][interleave.SETTLE :] + [*range(20, 29)][interleave.SETTLE :]
    assert seconds == pytest.approx([0.1] * len(batches))
    assert stages["forward"] == pytest.approx(0.05)  # both trainers, the counted iterations
    assert set(stages) == {"forward"}


def test_an_iteration_across_a_freeze_and_the_warm_up_do_not_count() -> None:
    # the third iteration started before its slice (it spans the freeze): it is left out, and the
    # slowest trainer's time is the iteration's
    ends = [1.1, 1.2, 1.9, 2.0, 2.1, 2.2, 2.3, 2.4]
    fast = trainer_log(ends, 0.1, 0.0)
    slow = trainer_log(ends, 0.1, 0.0)
    slow[2]["iteration_seconds"] = "0.8"
    for r in slow[3:]:
        r["iteration_seconds"] = "0.09"
    batches, seconds, _ = interleave.in_slices([fast, slow], [(1.5, 3.0)], skip=0)
    assert 2 not in batches
    assert batches == [3, 4, 5, 6, 7][interleave.SETTLE :]
    assert seconds == pytest.approx([0.1] * len(batches))
    # the warm-up's iterations inside a slice settle it too
    assert interleave.in_slices([fast, slow], [(1.5, 3.0)], skip=6)[0] == [6, 7]


def test_a_job_counts_as_warm_once_its_data_processors_have_stopped_using_cpu(monkeypatch) -> None:
    """``Quiet`` finds the job's data processors (children of its launcher, by command line) and says they
    are done only after their CPU has stood still for ``DATA_QUIET_S``."""
    monkeypatch.setattr(interleave, "DATA_QUIET_S", 0.3)
    busy = (
        "import time, sys\nt = time.process_time()\nwhile time.process_time() - t < 0.4: pass\ntime.sleep(60)"
    )
    # (this process stands for the launcher: the busy child is its data processor)
    proc = subprocess.Popen([sys.executable, "-c", busy, "bagpipe.data_processor"])
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        quiet = interleave.Quiet(os.getpid())
        assert interleave.Quiet(other.pid)() is False  # (a launcher without a data processor: never warm)
        answers = []
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not (answers and answers[-1]):
            answers.append(quiet())
            time.sleep(0.02)
        assert answers[0] is False and answers[-1] is True
        assert quiet.cpu >= 0.3  # the CPU it burnt before going quiet was seen
        assert quiet.pids == [proc.pid]
    finally:
        for p in (proc, other):
            p.kill()
            p.wait()


def test_service_cpu_is_summed_by_kind_from_the_launchers_children() -> None:
    """``service_cpu`` reads each kind's CPU from the children of the launcher whose command line names
    its module, as the launcher's summary sums it; other children count for nothing."""
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.4: pass\ntime.sleep(60)"
    # (this process stands for the launcher)
    children = [
        subprocess.Popen([sys.executable, "-c", burn, "bagpipe.trainer", "--rank", str(r)]) for r in range(2)
    ]
    children.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "elsewhere"]))
    try:
        deadline = time.monotonic() + 20
        cpu = interleave.service_cpu(os.getpid())
        while time.monotonic() < deadline and cpu["trainer"] < 0.6:
            time.sleep(0.05)
            cpu = interleave.service_cpu(os.getpid())
        # both trainers' CPU (0.4 s each; /proc counts in ticks, and one alone stays under 0.5)
        assert cpu["trainer"] >= 0.6
        assert set(cpu) == set(interleave.SERVICE_MODULES)
        assert cpu["embedding-server"] == cpu["data-processor"] == cpu["oracle-cacher"] == 0.0
    finally:
        for p in children:
            p.kill()
            p.wait()


def test_cpu_is_counted_from_the_hold_to_the_end_of_the_job() -> None:
    """A job's CPU an iteration is its services' CPU at its end (the launcher's summary) less their CPU
    when it was held, over the iterations in between; without either reading, nothing is made up."""
    summary = {"cpu_seconds_at_end": {"trainer": 9.0, "data-processor": 3.5}}
    at_hold = {"trainer": 5.0, "data-processor": 3.5, "embedding-server": 0.0}
    assert interleave.cpu_ms_since(at_hold, summary, 200) == {"trainer": 20.0, "data-processor": 0.0}
    assert interleave.cpu_ms_since({}, summary, 200) is None
    assert interleave.cpu_ms_since(at_hold, {}, 200) is None
    assert interleave.cpu_ms_since(at_hold, summary, 0) is None
