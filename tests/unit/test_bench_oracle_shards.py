"""The oracle-shards benchmark (bench/oracle_shards.py): K shards fed their parts of the same batches plan
them between them, each shard timed alone and, in processes of their own, at once; a trainer's merge of the
parts is timed; trainer counts beyond MAX_TRAINERS are reported refused."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from bagpipe.core.plans import MAX_TRAINERS

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
oracle_shards = pytest.importorskip("oracle_shards")


def test_each_shard_is_timed_and_the_rate_is_the_slowest_shards() -> None:
    r = oracle_shards.measure(
        [1, 3],
        [8, 80, MAX_TRAINERS + 1],
        [1, 2],
        batch_size=160 * 8,
        tables=3,
        lookahead=4,
        timed=6,
        concurrent_timed=5,
        repeats=2,
    )
    one, three, wide_one, wide_three, refused = r["points"]
    assert (one["oracles"], three["oracles"]) == (1, 3) and len(three["shard_seconds"]) == 3
    assert min(three["shard_seconds"]) > 0  # (every shard planned keys of every batch)
    assert three["samples_per_second"] == pytest.approx(6 * 1280 / max(three["shard_seconds"]))
    assert three["samples_per_second_one_core"] <= three["samples_per_second"]
    assert three["trainer_ms_per_batch"] > 0
    # a trainer receives K plan parts: the batch's rows once between them, and its samples once
    ratio = three["bytes_per_trainer_per_batch"] / one["bytes_per_trainer_per_batch"]
    assert 0.9 < ratio < 1.5, ratio
    assert (wide_one["trainers"], wide_three["oracles"]) == (80, 3)  # (wide masks plan too)
    assert refused == {
        "trainers": MAX_TRAINERS + 1,
        "refused": f"at most {MAX_TRAINERS} trainers (MAX_TRAINERS)",
    }
    # K shard processes at once, each timed; the rate is the slowest one's
    at_once = {p["oracles"]: p for p in r["concurrent"]}
    assert len(at_once[2]["shard_seconds"]) == 2 and min(at_once[2]["shard_seconds"]) > 0
    assert at_once[2]["samples_per_second"] == pytest.approx(5 * 1280 / max(at_once[2]["shard_seconds"]))
    assert [len(p["runs"]) for p in at_once.values()] == [2, 2]  # (the Ks in turns, the best run each)
    assert all(p["samples_per_second"] == max(p["runs"]) for p in at_once.values())
    assert r["speedup_2_over_1"] == pytest.approx(
        at_once[2]["samples_per_second"] / at_once[1]["samples_per_second"]
    )
