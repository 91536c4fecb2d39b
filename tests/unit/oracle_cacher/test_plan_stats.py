"""``bagpipe plan-stats``: the three cache designs planned over the same batches."""

from __future__ import annotations

import json

import pytest
from bagpipe.cli import main


def test_plan_stats_compares_replicated_lrpp_and_delayed_sync(capsys: pytest.CaptureFixture[str]) -> None:
    main(
        [
            "plan-stats",
            "--scale",
            "0.002",
            "--batch-size",
            "512",
            "--trainers",
            "4",
            "--lookahead",
            "6",
            "--iterations",
            "12",
            "--json",
        ]
    )
    r = json.loads(capsys.readouterr().out)
    rep, lrpp, delayed = (r["modes"][m] for m in ("replicated", "lrpp", "lrpp+delayed"))
    assert r["iterations"] == 12 and r["trainers"] == 4
    assert rep["unique"] == lrpp["unique"] == delayed["unique"] > 0
    # replicated: every trainer fetches every new row and every row is all-reduced before the next batch
    assert rep["critical_rows"] == rep["unique"] and rep["background_rows"] == 0
    assert lrpp["prefetched"] < rep["prefetched"]
    assert lrpp["background_rows"] == 0 and lrpp["critical_rows"] < rep["critical_rows"]
    # delaying moves synchronisation off the critical path without dropping any
    assert delayed["critical_rows"] + delayed["background_rows"] == pytest.approx(lrpp["critical_rows"])
    assert 0 < delayed["critical_rows"] < lrpp["critical_rows"]
    assert delayed["critical_rows_vs_replicated"] > lrpp["critical_rows_vs_replicated"] > 0


def test_plan_stats_table_names_every_design(capsys: pytest.CaptureFixture[str]) -> None:
    main(
        [
            "plan-stats",
            "--scale",
            "0.002",
            "--batch-size",
            "256",
            "--trainers",
            "2",
            "--lookahead",
            "3",
            "--iterations",
            "4",
        ]
    )
    out = capsys.readouterr().out
    assert all(m in out for m in ("replicated", "lrpp", "lrpp+delayed", "critical rows"))


def test_plan_stats_rejects_a_batch_that_does_not_split(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit, match="does not split over 3 trainers"):
        main(["plan-stats", "--batch-size", "100", "--trainers", "3", "--iterations", "2"])


def test_oracle_shards_plan_every_key_by_the_same_rules(capsys: pytest.CaptureFixture[str]) -> None:
    """Planning by key range (``--oracles K``): each key's decisions depend on its own accesses alone, so
    with an unbounded cache K shards prefetch and synchronise exactly the rows one oracle does; each shard
    is timed alone and plans its own part of the keys."""
    figures = {}
    for oracles in (1, 3):
        argv = ["plan-stats", "--scale", "0.002", "--batch-size", "512", "--trainers", "4"]
        main([*argv, "--lookahead", "6", "--iterations", "12", "--oracles", str(oracles), "--json"])
        figures[oracles] = json.loads(capsys.readouterr().out)
    one, three = figures[1], figures[3]
    assert three["oracles"] == 3 and len(three["shards"]) == 3
    assert three["iterations"] == one["iterations"] == 12
    for mode in ("replicated", "lrpp", "lrpp+delayed"):
        for figure in ("unique", "prefetched", "critical_rows", "background_rows", "critical_bytes"):
            assert three["modes"][mode][figure] == pytest.approx(one["modes"][mode][figure]), (mode, figure)
    parts = [s["unique_per_iteration"] for s in three["shards"]]
    assert sum(parts) == pytest.approx(one["modes"]["lrpp"]["unique"]) and min(parts) > 0
    assert three["slowest_shard_seconds"] <= three["planning_seconds"]
