"""The oracle-shards benchmark (bench/oracle_shards.py): K planners fed their parts of the same batches
plan them between them, each shard timed, and trainer counts beyond MAX_TRAINERS are reported refused."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from bagpipe.core.plans import MAX_TRAINERS

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
oracle_shards = pytest.importorskip("oracle_shards")


def test_each_shard_is_timed_and_the_rate_is_the_slowest_shards() -> None:
    r = oracle_shards.measure([1, 3], [2, MAX_TRAINERS + 1], batch_size=64, tables=3, lookahead=4, timed=6)
    one, three, refused = r["points"]
    assert (one["oracles"], three["oracles"]) == (1, 3) and len(three["shard_seconds"]) == 3
    assert min(three["shard_seconds"]) > 0  # (every shard planned keys of every batch)
    assert three["samples_per_second"] == pytest.approx(6 * 64 / max(three["shard_seconds"]))
    assert three["samples_per_second_one_core"] <= three["samples_per_second"]
    # a trainer receives K plan parts: the batch's rows once between them, and its samples once
    ratio = three["bytes_per_trainer_per_batch"] / one["bytes_per_trainer_per_batch"]
    assert 0.9 < ratio < 1.5, ratio
    assert refused == {
        "trainers": MAX_TRAINERS + 1,
        "refused": f"at most {MAX_TRAINERS} trainers (MAX_TRAINERS)",
    }
