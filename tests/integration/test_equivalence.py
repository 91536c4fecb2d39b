"""The promise: a Bagpipe run computes the same model as single-process synchronous training.

Each test runs the real services as processes (Redis, gRPC, gloo) and compares the final interchange
checkpoint with ``core.reference`` trained from the run's own initial checkpoint on the same
global batches.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bagpipe.core import checkpoint
from bagpipe.core.data import CriteoConfig, CriteoTSVSource, SyntheticConfig, SyntheticSource, scaled_table_rows
from bagpipe.core.model import DLRMConfig
from bagpipe.core.optim import OptimizerConfig
from bagpipe.core.reference import train_reference

TOLERANCE = 1e-4
MODEL = DLRMConfig(embedding_dim=8, bottom_mlp=(16, 8), top_mlp=(16, 1))


def synthetic_batches(iterations: int, batch_size: int = 64, seed: int = 0, alpha: float = 1.1):
    source = SyntheticSource(SyntheticConfig(table_rows=tuple(scaled_table_rows(0.0005)), seed=seed, zipf_alpha=alpha))
    return [source.batch(b, batch_size) for b in range(iterations)]


def assert_same_model(final_path: Path, expected: dict) -> None:
    final = checkpoint.load(final_path)
    diffs = checkpoint.max_abs_difference(final, expected)
    worst = max(diffs, key=lambda k: diffs[k])
    assert diffs[worst] <= TOLERANCE, f"{worst} differs by {diffs[worst]:.3g}"
    # the test must be able to fail: training moved the model well beyond the tolerance
    moved = checkpoint.max_abs_difference(checkpoint.load(str(final_path).replace("final", "initial")), expected)
    assert max(moved.values()) > 100 * TOLERANCE


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_two_trainers_two_servers_match_synchronous_training(run_job, optimizer: str) -> None:
    iterations = 12
    summary, paths = run_job(
        optimizer, "--trainers", "2", "--embedding-servers", "2", "--lookahead", "4",
        "--iterations", str(iterations), "--optimizer", optimizer, "--lr", "0.05",
    )  # fmt: skip
    assert summary["iterations"] == iterations
    assert 0 < summary["cache_hit_rate"] < 1, "rows must be both reused from the cache and prefetched"
    expected = train_reference(
        checkpoint.load(paths["initial"]), synthetic_batches(iterations), MODEL, OptimizerConfig(optimizer, 0.05)
    )
    assert_same_model(paths["final"], expected)


def test_one_trainer_lookahead_one_equals_three_servers_lookahead_eight(run_job) -> None:
    common = ("--iterations", "10", "--optimizer", "adagrad", "--lr", "0.05")
    _, small = run_job("t1s1l1", "--trainers", "1", "--embedding-servers", "1", "--lookahead", "1", *common)
    _, big = run_job("t2s3l8", "--trainers", "2", "--embedding-servers", "3", "--lookahead", "8", *common)
    a, b = checkpoint.load(small["initial"]), checkpoint.load(big["initial"])
    assert max(checkpoint.max_abs_difference(a, b).values()) == 0.0, "the initial model must not depend on S"
    assert_same_model(small["final"], checkpoint.load(big["final"]))


def test_criteo_tsv_run_starting_from_a_checkpoint_matches_reference(run_job, tmp_path: Path) -> None:
    rows = [5, 7, 50, 40, 3, 4, 30, 6, 3, 20, 9, 45, 8, 4, 11, 35, 4, 6, 5, 4, 33, 4, 4, 12, 4, 9]
    lines = []
    for i in range(8 * 32):
        ints = ["" if i % 7 == 0 else str((i * 13 + k) % 50 - (k == 2)) for k in range(13)]
        cats = ["" if (i + k) % 11 == 0 else format((i * 2654435761 + k * 97) % (1 << 32) % (3 + (i % 5) * 40), "x") for k in range(26)]
        lines.append("\t".join([str((i * 7) % 3 % 2), *ints, *cats]))
    data = tmp_path / "day.tsv"
    data.write_text("\n".join(lines) + "\n")
    table_rows = ",".join(map(str, rows))
    _, first = run_job("criteo-a", "--data", f"criteo:{data}", "--table-rows", table_rows, "--iterations", "2",
                       "--trainers", "1", "--embedding-servers", "1", "--optimizer", "adagrad", "--batch-size", "32")  # fmt: skip
    # continue from the first run's checkpoint with a different layout; the reference continues too
    _, second = run_job("criteo-b", "--data", f"criteo:{data}", "--table-rows", table_rows, "--iterations", "0",
                        "--trainers", "2", "--embedding-servers", "2", "--lookahead", "3", "--optimizer", "adagrad",
                        "--batch-size", "32", "--init-from", str(first["final"]))  # fmt: skip
    source = CriteoTSVSource(CriteoConfig(paths=(str(data),), table_rows=tuple(rows)))
    batches = [s for _, s in source.batches(32)]
    assert len(batches) == 8
    expected = train_reference(checkpoint.load(first["final"]), batches, MODEL, OptimizerConfig("adagrad", 0.1))
    assert_same_model(second["final"], expected)
