"""Rows mostly on disk (``--row-memory`` a fraction of each shard): the same model as synchronous training,
undisturbed, through a server's and a trainer's failure, and through re-sharding."""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest

from tests.integration.conftest import BackgroundRun, exact_flags
from tests.integration.test_equivalence import assert_synchronous
from tests.integration.test_recovery import run_with_failure
from tests.integration.test_resharding import _scaled, _trained, _when_trained

# (the tiny tables: rows of 64 bytes with their state, a few thousand written per shard in a test run; 24 KiB
# holds 384 of them)
BUDGET = ("--row-memory", "24KiB")


def _tier(run_dir: Path) -> dict[str, dict[str, float]]:
    """Each server's tier figures from its last scrape (``run_dir/metrics/embedding_server-<shard>.prom``)."""
    found = {}
    for path in sorted((run_dir / "metrics").glob("embedding_server-*.prom")):
        text = path.read_text()
        figures = {
            m.group(1) + (f"{{{m.group(2)}}}" if m.group(2) else ""): float(m.group(3))
            for m in re.finditer(
                r"^bagpipe_embedding_server_tier_(\w+?)(?:_total)?(?:\{(.*?)\})? (\S+)$", text, re.M
            )
        }
        found[path.stem] = figures
    return found


def _mostly_on_disk(run_dir: Path) -> None:
    tiers = _tier(run_dir)
    assert tiers, "no server reported a row tier"
    for name, figures in tiers.items():
        assert figures["rows_in_memory"] <= figures["memory_rows"], (name, figures)
        assert figures["rows_on_disk"] > 2 * figures["memory_rows"], (name, figures)
        assert figures['rows{op="written"}'] > 0 and figures['disk_bytes{op="read"}'] > 0, (name, figures)


@pytest.mark.parametrize("policy", ["lookahead", "lru", "next-batch"])
def test_rows_mostly_on_disk_train_the_synchronous_model(run_job, tmp_path: Path, policy: str) -> None:
    """With each policy (the benchmark's baselines too): what to keep never changes a value."""
    iterations, batch = 40, 64
    _, paths = run_job("tier", *exact_flags(iterations, batch, "adagrad"), *BUDGET, "--row-policy", policy)
    assert_synchronous(paths, iterations, batch, "adagrad")
    _mostly_on_disk(tmp_path / "tier")
    assert not list((tmp_path / "tier" / "rows").rglob("*.log")), "a server left its rows' file behind"


def test_a_server_and_a_trainer_failing_with_rows_on_disk_stay_exact(run_job, tmp_path: Path) -> None:
    iterations, batch = 30, 64
    for target, blamed in (
        ("bagpipe.embedding_server --shard 1", "embedding-server-1"),
        ("bagpipe.trainer --rank 1", "trainer-1"),
    ):
        name = blamed.replace("-", "_")
        summary, paths, _ = run_with_failure(
            run_job,
            tmp_path,
            name,
            target,
            signal.SIGKILL,
            12,
            *exact_flags(iterations, batch, "sgd"),
            *BUDGET,
        )
        assert [f["component"] for f in summary["recovery"]["failures"]] == [blamed], summary["recovery"]
        assert_synchronous(paths, iterations, batch, "sgd")


def test_re_sharding_moves_rows_from_disk_and_stays_exact(run_job, tmp_path: Path) -> None:
    iterations, batch = 400, 64
    extra = exact_flags(iterations, batch, "adagrad", migration_rows_per_second=20000)
    job = BackgroundRun(run_job, "scaled", *extra, *BUDGET, "--lookup-threads", "2")
    run_dir = tmp_path / "scaled"
    try:
        _when_trained(run_dir, 10, job)
        _scaled(run_dir, 3)
        _when_trained(run_dir, _trained(run_dir) + 3, job)
        _scaled(run_dir, 1)
        finished_at = _trained(run_dir)
    finally:
        summary, paths = job.result()
    assert finished_at < iterations, "the migrations did not happen while training"
    assert summary["embedding_servers"] == 1 and summary["iterations"] == iterations
    assert_synchronous(paths, iterations, batch, "adagrad")
    _mostly_on_disk(run_dir)
