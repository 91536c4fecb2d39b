"""K oracle shards (``--oracles``): each plans its keys' part of every batch, the trainers merge the parts,
and the model is the one single-process synchronous training computes, with a cache small enough to bind
and through the loss of one shard."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from tests.integration.conftest import exact_flags, flags
from tests.integration.test_equivalence import assert_synchronous
from tests.integration.test_recovery import run_with_failure
from tests.integration.test_row_tier import _tier


@pytest.mark.parametrize(("oracles", "trainers", "optimizer"), [(2, 2, "adagrad"), (3, 3, "sgd")])
def test_oracle_shards_train_the_synchronous_model(
    run_job, oracles: int, trainers: int, optimizer: str
) -> None:
    """LRPP with delayed synchronisation, L=8 (rows change hands), 2 embedding servers, a checkpoint every 5
    batches (each flushes the rows every shard holds in the cache)."""
    iterations, batch = 24, 32 * trainers
    summary, paths = run_job(
        f"oracles{oracles}", *exact_flags(iterations, batch, optimizer, trainers=trainers, oracles=oracles)
    )
    assert summary["iterations"] == iterations
    assert 0 < summary["cache_hit_rate"] < 1
    assert summary["rows_private_per_iteration"] > 0 and summary["rows_handed_over"] > 0
    assert summary["rows_synced_critical_per_iteration"] > 0
    assert_synchronous(paths, iterations, batch, optimizer)
    # every shard planned every batch, and says how long it took and how many bytes it sent
    for shard in range(oracles):
        text = (
            paths["final"].parent / f"oracles{oracles}" / "metrics" / f"oracle_cacher-{shard}.prom"
        ).read_text()
        figures = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
        assert float(figures["bagpipe_oracle_cacher_plan_seconds_count"]) == iterations, shard
        assert float(figures["bagpipe_oracle_cacher_plan_bytes_total"]) > 0, shard
    # the processors built each batch once for the K shards' streams, which took their parts of it
    built = shared = 0.0
    for path in (paths["final"].parent / f"oracles{oracles}" / "metrics").glob("data_processor-*.prom"):
        figures = dict(
            line.rsplit(" ", 1) for line in path.read_text().splitlines() if line and not line.startswith("#")
        )
        built += float(figures["bagpipe_data_processor_batch_build_seconds_count"])
        shared += float(figures["bagpipe_data_processor_shared_batches_total"])
    assert (built, shared) == (iterations, iterations * (oracles - 1))


def test_a_binding_cache_split_between_oracle_shards_stays_exact(run_job) -> None:
    """--cache-rows is split between the shards (each its part); each shards picks its own L from it."""
    iterations, cache_rows = 24, 450
    summary, paths = run_job(
        "oracles-small-cache",
        *flags(
            trainers=2,
            oracles=2,
            cache_rows=cache_rows,
            max_lookahead=8,
            iterations=iterations,
            optimizer="adagrad",
            lr="0.05",
        ),
    )
    assert summary["iterations"] == iterations
    assert 1 <= summary["lookahead"]["min"] < 8, "the cache must bind"
    assert summary["cache_peak_occupancy_rows"] <= cache_rows
    assert_synchronous(paths, iterations, 64, "adagrad")


def test_a_killed_oracle_shard_rewinds_every_shard_and_the_model_is_exact(run_job, tmp_path: Path) -> None:
    iterations, batch, optimizer = 30, 64, "adagrad"
    summary, paths, _ = run_with_failure(
        run_job,
        tmp_path,
        "oracle-shard",
        "bagpipe.oracle_cacher --shard 1",
        signal.SIGKILL,
        9,
        *exact_flags(iterations, batch, optimizer, oracles=2, failure_timeout=3),
    )
    failure = summary["recovery"]["failures"]
    assert len(failure) == 1 and failure[0]["component"] == "oracle-cacher-1", json.dumps(failure)
    assert failure[0]["resumed_at_batch"] % 5 == 0
    assert summary["iterations"] == iterations
    assert_synchronous(paths, iterations, batch, optimizer)


def test_rows_on_disk_follow_every_oracle_shards_fetch_stream(run_job, tmp_path: Path) -> None:
    """A row tier reads ahead the rows of every shard's plans (its fetch streams merged batch by batch)."""
    iterations, batch = 40, 64
    _, paths = run_job(
        "oracles-tier", *exact_flags(iterations, batch, "adagrad", oracles=2), "--row-memory", "24KiB"
    )
    assert_synchronous(paths, iterations, batch, "adagrad")
    tiers = _tier(tmp_path / "oracles-tier")
    assert tiers and all(t['rows{op="prefetched"}'] > 0 for t in tiers.values()), tiers
