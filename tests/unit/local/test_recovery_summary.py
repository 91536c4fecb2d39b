"""``summary.recovery_summary``: what a run's summary says about its failures."""

from __future__ import annotations

from pathlib import Path

from bagpipe.local.summary import recovery_summary


def _failure(start: int, last: int) -> dict:
    return {
        "generation": 0,
        "component": "trainer-1",
        "start_batch": start,
        "trained_batches": 0,
        "last_batch": last,
    }


def test_replayed_iterations_count_from_the_checkpoint_resumed_to_the_last_batch_trained(
    tmp_path: Path,
) -> None:
    failures = [_failure(0, 13), _failure(10, 22)]
    stats = [{"first_batch": 20, "iterations": 30, "checkpoints": [{"seconds": 0.5}, {"seconds": 1.5}]}]
    s = recovery_summary(failures, stats, tmp_path, 5, tmp_path / "ckpt")
    assert [f["resumed_at_batch"] for f in s["failures"]] == [10, 20]
    assert [f["replayed_iterations"] for f in s["failures"]] == [4, 3] and s["iterations_replayed"] == 7
    assert s["checkpoints"] == 2 and s["checkpoint_seconds_mean"] == 1.0


def test_a_batch_the_log_lost_to_the_kill_counts_as_trained_when_its_checkpoint_is_resumed_from(
    tmp_path: Path,
) -> None:
    """A trainer seals the checkpoint after batch 14 inside that batch's step, then logs the batch: killed
    in between, its log ends at 13 while the next generation resumes at 15."""
    s = recovery_summary([_failure(0, 13)], [{"first_batch": 15, "iterations": 30}], tmp_path, 5, tmp_path)
    (f,) = s["failures"]
    assert f["last_batch"] == 14 and f["resumed_at_batch"] == 15 and f["replayed_iterations"] == 0
