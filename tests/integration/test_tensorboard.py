"""``--tensorboard DIR``: trainer 0's curves as TensorBoard event files, read back here with TensorBoard's
own reader; after a recovery the replayed batches are shown once, as the run counted them."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.integration.conftest import exact_flags
from tests.integration.test_recovery import run_with_failure


def _scalars(directory: Path) -> dict[str, dict[int, float]]:
    """tag -> {step: value}; where a step was written twice (a replay), the last write."""
    events = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def test_the_curves_are_the_runs(run_job, tmp_path: Path) -> None:
    board = tmp_path / "board"
    summary, _ = run_job(
        "tb",
        "--iterations",
        "12",
        "--eval-data",
        "synthetic",
        "--eval-every",
        "6",
        "--tensorboard",
        str(board),
    )
    scalars = _scalars(board)
    loss = scalars["train/loss"]
    assert sorted(loss) == list(range(12))
    assert [loss[b] for b in range(12)] == pytest.approx(summary["losses"], rel=1e-6)
    assert sorted(scalars["eval/auc"]) == [6, 12]
    assert [scalars["eval/auc"][b] for b in (6, 12)] == pytest.approx(
        [e["auc"] for e in summary["evaluations"]]
    )
    for tag in ("time/forward_seconds", "time/iteration_seconds", "cache/hit_rate", "rows/prefetched"):
        assert sorted(scalars[tag]) == list(range(12)), tag
    assert all(0.0 <= v <= 1.0 for v in scalars["cache/hit_rate"].values())
    assert scalars["recovery/generation"] == {0: 1.0}  # (the job's first generation)
    assert list(board.glob("events.out.tfevents.*")), "no event file"


def test_a_recovery_shows_each_batch_once_and_the_new_generation(run_job, tmp_path: Path) -> None:
    board = tmp_path / "board"
    iterations = 24
    summary, _, _ = run_with_failure(
        run_job,
        tmp_path,
        "tb-chaos",
        "bagpipe.trainer --rank 1",
        signal.SIGKILL,
        9,
        *exact_flags(iterations, 64, "adagrad", failure_timeout=3),
        "--tensorboard",
        str(board),
    )
    failure = summary["recovery"]["failures"][0]
    scalars = _scalars(board)
    loss = scalars["train/loss"]
    # every batch once, with the loss the run ended up counting (the replay's, which equals the first)
    assert sorted(loss) == list(range(iterations))
    assert [loss[b] for b in range(iterations)] == pytest.approx(summary["losses"], rel=1e-6)
    generations = scalars["recovery/generation"]
    assert generations[0] == 1.0 and generations[failure["resumed_at_batch"]] == 2.0
