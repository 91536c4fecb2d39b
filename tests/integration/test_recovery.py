"""Exact recovery: any one service dies or freezes mid-run and the final model is still the synchronous one.

Each case runs a real local job (``bagpipe run``'s launcher in a thread of this process), waits for rank 0's
iteration log to reach a batch drawn at random (seeded, printed), and then signals one child process of
the launcher, found by its command line as an operator would (``python -m bagpipe.<service>``, or the
``redis-server``). The run must detect the failure, roll back to its last checkpoint, replay, and end with
the model of single-process synchronous training on the same batches.
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest
from bagpipe.core import checkpoint
from bagpipe.local.keeper import children_matching

from tests.integration.conftest import BackgroundRun, exact_flags, flags
from tests.integration.test_equivalence import assert_same_model, assert_synchronous


def _trained(run_dir: Path) -> int:
    path = run_dir / "metrics" / "trainer-0.csv"
    try:
        return max(0, len(path.read_text().splitlines()) - 1)
    except OSError:
        return 0


def run_with_failure(run_job, tmp_path: Path, name: str, target: str, sig: int, at: int, *flags: str):
    """Runs the job; once rank 0 has trained ``at`` batches, signals the child matching ``target``.
    Returns the run's (summary, paths) and the process ids of every embedding server seen from the signal
    to the end of training (each server's, once: a server started again shows a second one)."""
    job = BackgroundRun(run_job, name, *flags)
    run_dir = tmp_path / name
    deadline = time.monotonic() + 120
    while _trained(run_dir) < at and job.alive() and time.monotonic() < deadline:
        time.sleep(0.005)
    pids = children_matching(target)
    assert job.alive() and len(pids) == 1, f"no single live {target!r} to signal at batch {at}: {pids}"
    servers = set(children_matching("bagpipe.embedding_server"))
    os.kill(pids[0], sig)
    while job.alive() and not (run_dir / "summary.json").exists():
        servers |= set(children_matching("bagpipe.embedding_server"))
        time.sleep(0.05)
    return (*job.result(), servers)


CASES = [
    # (target command line, signal, trainers, optimizer, what the detector must blame)
    ("bagpipe.trainer --rank 1", signal.SIGKILL, 2, "adam", "trainer-1"),
    ("bagpipe.trainer --rank 2", signal.SIGSTOP, 3, "adagrad", "trainer-2"),
    ("bagpipe.embedding_server --shard 1", signal.SIGKILL, 3, "adam", "embedding-server-1"),
    ("bagpipe.embedding_server --shard 0", signal.SIGSTOP, 2, "adagrad", "embedding-server-0"),
    ("bagpipe.oracle_cacher", signal.SIGKILL, 2, "adagrad", "oracle-cacher"),
    ("redis-server", signal.SIGKILL, 2, "sgd", "redis"),
]


@pytest.mark.parametrize(
    ("target", "sig", "trainers", "optimizer", "blamed"),
    CASES,
    ids=[f"{c[4]}-{signal.Signals(c[1]).name}" for c in CASES],
)
def test_a_failed_service_is_recovered_and_the_model_is_exact(
    run_job, tmp_path: Path, target: str, sig: int, trainers: int, optimizer: str, blamed: str
) -> None:
    """LRPP and delayed synchronisation on, L=8 (rows change hands), a checkpoint every 5 batches."""
    # (30 batches: with Adagrad's zero initial accumulator, float noise in a near-zero first gradient can
    # flip a row's first step; 40 batches of T=3 show it even without any failure)
    iterations, batch = 30, 32 * trainers
    at = random.Random(f"{target}-{sig}").randint(7, 14)
    print(f"signal {signal.Signals(sig).name} to {target!r} after batch {at}")
    servers_before = set(children_matching("bagpipe.embedding_server"))
    assert not servers_before
    summary, paths, servers = run_with_failure(
        run_job,
        tmp_path,
        "chaos",
        target,
        sig,
        at,
        *exact_flags(iterations, batch, optimizer, trainers=trainers, failure_timeout=3),
    )
    recovery = summary["recovery"]
    assert recovery["failures_detected"] == 1, recovery
    failure = recovery["failures"][0]
    assert failure["component"] == blamed, failure
    assert failure["kind"] == ("exited" if sig == signal.SIGKILL else "gone"), failure
    assert failure["resumed_at_batch"] % 5 == 0
    assert failure["resumed_at_batch"] <= failure["last_batch"] + 1
    # recovery in place: only the failed process is replaced (with Redis, everything registered is lost)
    servers_expected = 2 + (1 if blamed.startswith("embedding-server") else 0)
    if blamed != "redis":
        assert len(servers) == servers_expected, f"embedding server processes seen: {sorted(servers)}"
    assert summary["iterations"] == iterations
    assert summary["rows_private_per_iteration"] > 0 and summary["rows_handed_over"] > 0
    assert_synchronous(paths, iterations, batch, optimizer)


def _streamed(run_dir: Path, member: str) -> int:
    """The batches data processor ``member`` streamed, from the run's last scrape of its /metrics."""
    text = (run_dir / "metrics" / f"data_processor-{member}.prom").read_text()
    for line in text.splitlines():
        if line.startswith("bagpipe_data_processor_batches_total "):
            return int(float(line.split()[1]))
    raise AssertionError(f"no bagpipe_data_processor_batches_total in data_processor-{member}.prom")


def test_a_data_processor_killed_mid_stream_is_rewound_and_the_model_is_exact(
    run_job, tmp_path: Path
) -> None:
    """The processor is killed while its stream still has batches to send, the job rolls back to its last
    checkpoint, and the processor started again streams from there to the end.

    The stream runs ahead of training by what the oracle holds (its window of L=8, the plans not yet
    trained and its reorder buffer) and one 1 MiB stream window, about 60 batches of this size
    (``serving.FIXED_WINDOW``): with 150 batches and the kill by batch 9, it is mid-stream. SGD: over
    150 batches of 3 trainers, Adagrad's float noise alone moves a row past the tolerance."""
    iterations, trainers = 150, 3
    batch = 32 * trainers
    at = random.Random("data-processor-0").randint(6, 9)  # (after checkpoint 5: the rewind is to it)
    print(f"SIGKILL to the data processor after batch {at}")
    summary, paths, _ = run_with_failure(
        run_job,
        tmp_path,
        "rewound",
        "bagpipe.data_processor",
        signal.SIGKILL,
        at,
        *exact_flags(iterations, batch, "sgd", trainers=trainers, failure_timeout=3),
    )
    recovery = summary["recovery"]
    # a stream broken before its end: the oracle that read it reports the processor failed (a processor
    # killed after its last batch would leave nothing to recover, and no failure)
    assert recovery["failures_detected"] == 1, recovery
    failure = recovery["failures"][0]
    assert (failure["component"], failure["kind"]) == ("data-processor-0", "failed"), failure
    resumed = failure["resumed_at_batch"]
    assert resumed % 5 == 0 and resumed <= failure["last_batch"] + 1 < iterations, failure
    # the processor started again streamed every batch from the checkpoint on, once
    assert _streamed(tmp_path / "rewound", "0") == iterations - resumed
    assert summary["iterations"] == iterations
    assert_synchronous(paths, iterations, batch, "sgd")


def test_a_run_that_keeps_failing_gives_up_naming_the_component(run_job, tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match=r"trainer-1 failed after 0 restarts \(--max-restarts\)"):
        run_with_failure(
            run_job,
            tmp_path,
            "give-up",
            "bagpipe.trainer --rank 1",
            signal.SIGKILL,
            8,
            *flags(iterations=40, checkpoint_every=5, max_restarts=0),
        )


def test_resume_continues_a_stopped_run_to_the_same_model(run_job, tmp_path: Path) -> None:
    """A run stopped after a checkpoint (its launcher killed) goes on with ``--resume`` from its last
    checkpoint and ends with the model of an uninterrupted run; the stopped run's ``--no-report`` does not
    carry over to the resuming command, which writes the report."""
    from bagpipe.cli import parse_run
    from bagpipe.local.launcher import run

    common = ("--iterations", "24", "--checkpoint-every", "4", "--optimizer", "adagrad", "--lr", "0.05")
    _, whole = run_job("whole", *common)
    _, part = run_job("part", *common)
    run_dir = tmp_path / "part"
    for later in sorted((run_dir / "checkpoints").iterdir())[-2:]:  # as if it had stopped after batch 15
        for f in later.iterdir():
            f.unlink()
        later.rmdir()
    Path(part["final"]).unlink()
    assert not (run_dir / "report.html").exists()  # (run_job's runs: --no-report)
    summary = run(parse_run(["--resume", str(run_dir), "--quiet"]))
    assert summary["iterations"] == 24
    # the report is the resuming command's choice (it asked for one), as the progress bar is
    assert summary["report"] == str(run_dir / "report.html") and (run_dir / "report.html").is_file()
    assert_same_model(part["final"], checkpoint.load(whole["final"]))


def test_a_long_run_killed_late_restores_from_a_bounded_chain_and_is_exact(run_job, tmp_path: Path) -> None:
    """Checkpoints every 5 batches, every third one full, the newest two kept: an embedding server killed
    late in the run and started again with the same flags restores its shard from a chain of at most three
    files a server, its peer rolls back in memory, and the model is the synchronous one."""
    from bagpipe.core import snapshots

    iterations, batch = 70, 64
    summary, paths, _ = run_with_failure(
        run_job,
        tmp_path,
        "long",
        "bagpipe.embedding_server --shard 1",
        signal.SIGKILL,
        52,
        *exact_flags(iterations, batch, "adagrad", failure_timeout=3),
        *flags(checkpoint_full_every=3, keep_checkpoints=2, log_level="INFO"),  # (the restore is logged)
    )
    recovery = summary["recovery"]
    assert recovery["failures_detected"] == 1 and recovery["failures"][0]["resumed_at_batch"] >= 45, recovery
    directory = tmp_path / "long" / "checkpoints"
    done = snapshots.complete(directory)
    assert len(done) <= 2 + 3 and done[-1] >= iterations - 5, done  # (pruned: the newest two, their links)
    assert all(len(snapshots.files_of(directory, n)) <= 3 * 2 for n in done)
    # what the restarted server read: the chain of the checkpoint the job resumed from; the other one
    # undid its rows in memory and read nothing
    logs = [(tmp_path / "long" / "logs" / f"embedding-server-{s}.log").read_text() for s in (0, 1)]
    restored = [line for line in logs[1].splitlines() if "restored" in line and "files" in line]
    assert len(restored) == 1, restored
    files = int(restored[0].split(" from ")[1].split()[0])
    assert 1 <= files <= 3 * 2, restored[0]
    assert "restored" not in logs[0] and "undid" in logs[0], logs[0][-2000:]
    assert_synchronous(paths, iterations, batch, "adagrad")


def test_a_slow_evaluation_is_not_taken_for_a_failure(run_job, tmp_path: Path) -> None:
    """A held-out evaluation far longer than --failure-timeout: the trainers' heartbeat goes on through
    it (and through the checkpoints and the final export), so the detector records no failure. The
    evaluation is made at least twice the timeout by construction: a run whose evaluation was shorter
    (a fast machine) is run again with the held-out set scaled from the measured time."""
    timeout, samples = 1.0, 1_500_000
    for attempt in range(2):
        summary, _ = run_job(
            f"slow-eval-{attempt}",
            *flags(
                iterations=20,
                checkpoint_every=5,
                eval_data="synthetic",
                eval_samples=samples,
                eval_every=10,
                failure_timeout=timeout,
            ),
        )
        assert len(summary["evaluations"]) == 2
        assert summary["recovery"]["failures_detected"] == 0, summary["recovery"]
        slowest = max(e["seconds"] for e in summary["evaluations"])
        if slowest > 2 * timeout:
            return
        if attempt == 0:
            samples = int(samples * 3 * timeout / slowest)  # (an evaluation's time grows with its samples)
    raise AssertionError(f"the evaluation took {slowest:.2f} s with {samples} samples: not slow enough")


def test_a_frozen_server_is_found_through_prometheus_and_replaced_in_place(run_job, tmp_path: Path) -> None:
    """With ``--prometheus`` the controller reads liveness from the real Prometheus's HTTP API, as in a
    cluster: a frozen embedding server is declared gone there, killed by pid and started again with its
    own flags; it serves nothing until the job is rolled back to the checkpoint it loaded, its peer rolls
    back in memory, and the model is the synchronous one."""
    iterations, batch = 40, 64
    summary, paths, servers = run_with_failure(
        run_job,
        tmp_path,
        "prometheus",
        "bagpipe.embedding_server --shard 0",
        signal.SIGSTOP,
        12,
        *exact_flags(iterations, batch, "adagrad", failure_timeout=3),
        "--prometheus",
        *flags(log_level="INFO"),
    )
    [failure] = summary["recovery"]["failures"]
    assert (failure["component"], failure["kind"]) == ("embedding-server-0", "gone"), failure
    assert len(servers) == 3  # the two first ones and shard 0's replacement
    controller = (tmp_path / "prometheus" / "logs" / "controller.log").read_text()
    assert "through prometheus" in controller.lower() or "prometheus at http" in controller, controller[:2000]
    peer = (tmp_path / "prometheus" / "logs" / "embedding-server-1.log").read_text()
    assert "undid" in peer and "restored" not in peer
    replaced = (tmp_path / "prometheus" / "logs" / "embedding-server-0.log").read_text()
    assert "restored" in replaced.split("---- ")[-1] or failure["resumed_at_batch"] == 0
    assert_synchronous(paths, iterations, batch, "adagrad")
