"""The oracle benchmark's replays (bench/oracle_throughput.py): the same batches planned again by new
planners give the same plans, and the figures reported are the fastest replay's, with every one kept."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from bagpipe.oracle_cacher.config import planner_cores

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
oracle_throughput = pytest.importorskip("oracle_throughput")


def test_replays_report_the_fastest_and_keep_every_one() -> None:
    r = oracle_throughput.measure(batch_size=64, tables=3, lookahead=4, timed=6, trainers=2, replays=3)
    assert len(r["replays"]) == 3
    every = [x["end_to_end_samples_per_second"] for x in r["replays"]]
    assert r["end_to_end_samples_per_second"] == max(every)
    assert min(every) <= r["end_to_end_median_of_replays"] <= max(every)
    assert r["end_to_end_ratio_to_target"] == r["end_to_end_samples_per_second"] / 5e6
    # the batches are planned alike each time: a replay differs in its timings only
    assert r["peak_occupancy_rows"] > 0
    assert {(x["plan_bytes_per_batch"], x["peak_occupancy_rows"]) for x in r["replays"]} == {
        (r["plan_bytes_per_batch"], r["peak_occupancy_rows"])
    }


def test_replays_must_be_positive() -> None:
    with pytest.raises(ValueError, match="replays"):
        oracle_throughput.measure(batch_size=64, tables=3, lookahead=4, timed=6, trainers=2, replays=0)


@pytest.mark.skipif(planner_cores() < 2, reason="one core: no second thread to plan with")
def test_threads_plan_the_same_batches_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--threads 2`` splits each batch between two threads (here every batch: parts of 4 keys or more)
    and plans it as one thread does: the same plan bytes and cache occupancy."""
    from bagpipe.oracle_cacher import lookahead

    monkeypatch.setattr(lookahead, "_MIN_PART", 4)
    one = oracle_throughput.measure(batch_size=64, tables=3, lookahead=4, timed=6, trainers=2)
    two = oracle_throughput.measure(batch_size=64, tables=3, lookahead=4, timed=6, trainers=2, threads=2)
    assert (one["threads"], two["threads"]) == (1, 2)
    assert one["unique_keys_per_batch"] >= 8
    for field in ("plan_bytes_per_batch", "peak_occupancy_rows", "unique_keys_per_batch"):
        assert one[field] == two[field], field
