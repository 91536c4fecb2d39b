"""The promise: a Bagpipe run computes the same model as single-process synchronous training.

Each test runs the real services as processes (Redis, gRPC, gloo) and compares the final interchange
checkpoint with ``core.reference`` trained from the run's own initial checkpoint on the same
global batches.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from bagpipe.core import checkpoint
from bagpipe.core.data import SyntheticConfig, SyntheticSource, scaled_table_rows
from bagpipe.core.model import ModelConfig
from bagpipe.core.optim import OptimizerConfig
from bagpipe.data_processor.files import CriteoConfig, CriteoTSVSource
from bagpipe.oracle_cacher.config import planner_cores

from tests.integration.conftest import adam_eps, flags
from tests.reference import train_reference

TOLERANCE = 1e-4
MODEL = ModelConfig(embedding_dim=8, bottom_mlp=(16, 8), top_mlp=(16, 1))


def synthetic_batches(iterations: int, batch_size: int = 64, seed: int = 0, alpha: float = 1.1):
    source = SyntheticSource(
        SyntheticConfig(table_rows=tuple(scaled_table_rows(0.0005)), seed=seed, zipf_alpha=alpha)
    )
    return [source.batch(b, batch_size) for b in range(iterations)]


def assert_synchronous(
    paths: dict[str, Path],
    iterations: int,
    batch: int,
    optimizer: str,
    lr: float = 0.05,
    model: ModelConfig = MODEL,
) -> None:
    """The run's final checkpoint is the model single-process synchronous training computes on its batches."""
    batches = synthetic_batches(iterations, batch)
    expected = train_reference(
        checkpoint.load(paths["initial"]),
        batches,
        model,
        OptimizerConfig(optimizer, lr, **adam_eps(optimizer)),
    )
    assert_same_model(paths["final"], expected)


def assert_same_model(final_path: Path, expected: dict, tolerance: float = TOLERANCE) -> None:
    final = checkpoint.load(final_path)
    diffs = checkpoint.max_abs_difference(final, expected)
    worst = max(diffs, key=lambda k: diffs[k])
    assert diffs[worst] <= tolerance, f"{worst} differs by {diffs[worst]:.3g}"
    # the test must be able to fail: training moved the parameters well beyond the tolerance
    initial = checkpoint.load(str(final_path).replace("final", "initial"))
    params = {k: v for k, v in expected.items() if k in ("dense", "embeddings", "linear")}
    moved = checkpoint.max_abs_difference({k: v for k, v in initial.items() if k in params}, params)
    assert max(moved.values()) > 100 * TOLERANCE


@pytest.mark.parametrize(
    ("trainers", "lookahead", "optimizer"),
    [(2, 4, "sgd"), (2, 4, "adagrad"), (3, 8, "sgd"), (3, 8, "adagrad")],
)
def test_trainers_match_synchronous_training(run_job, trainers: int, lookahead: int, optimizer: str) -> None:
    """LRPP and delayed synchronisation are on (the defaults); with L=8 rows change hands."""
    iterations, batch = 12 + 2 * lookahead, 32 * trainers
    summary, paths = run_job(
        f"t{trainers}-{optimizer}",
        *flags(
            trainers=trainers,
            embedding_servers=2,
            lookahead=lookahead,
            iterations=iterations,
            batch_size=batch,
            optimizer=optimizer,
            lr="0.05",
        ),
    )
    assert summary["iterations"] == iterations
    assert 0 < summary["cache_hit_rate"] < 1, "rows must be both reused from the cache and prefetched"
    assert summary["rows_private_per_iteration"] > 0, "some rows must be updated by one trainer only"
    assert summary["rows_synced_critical_per_iteration"] > 0
    assert summary["rows_synced_background_per_iteration"] > 0
    if lookahead == 8:
        assert summary["rows_handed_over"] > 0, "rows must change hands between trainers"
    # transfers are grouped (--transfer-batches 8 by default): fewer calls than batches
    assert summary["write_back_calls_per_iteration"] < trainers
    # rows used for the first time are computed by the trainers (the servers were untouched before batch
    # 0), rows evicted and used again are fetched: both paths feed the model compared below
    first, fetched = summary["rows_fetched_first_per_iteration"], summary["rows_fetched_per_iteration"]
    assert 0 < first < fetched
    assert_synchronous(paths, iterations, batch, optimizer)


def test_replicated_cache_with_critical_sync_matches_synchronous_training(run_job) -> None:
    iterations = 10
    summary, paths = run_job(
        "replicated",
        *flags(
            trainers=2,
            lookahead=4,
            iterations=iterations,
            cache_mode="replicated",
            sync="critical",
            optimizer="adagrad",
            lr="0.05",
            transfer_batches=1,
        ),
    )
    assert summary["rows_private_per_iteration"] == 0 and summary["rows_synced_background_per_iteration"] == 0
    assert (
        summary["lookup_calls_per_iteration"] <= 2 and summary["write_back_calls_per_iteration"] <= 2
    )  # one a batch
    assert_synchronous(paths, iterations, 64, "adagrad")


def test_a_cache_smaller_than_the_window_shrinks_lookahead_and_stays_exact(run_job) -> None:
    """No --lookahead: the oracle picks L from --cache-rows (live rows at L=8 peak near 580 here). The
    oracle plans with every core here (--planner-threads: numba's threads, in the service's process)."""
    iterations, cache_rows = 24, 450
    summary, paths = run_job(
        "small-cache",
        *flags(
            trainers=2,
            cache_rows=cache_rows,
            max_lookahead=8,
            iterations=iterations,
            optimizer="adagrad",
            lr="0.05",
            planner_threads=min(2, planner_cores()),
        ),
    )
    assert summary["iterations"] == iterations
    assert summary["lookahead"]["requested"] is None and 1 <= summary["lookahead"]["min"] < 8
    assert summary["cache_capacity_rows"] == cache_rows
    assert summary["cache_peak_occupancy_rows"] <= cache_rows
    assert_synchronous(paths, iterations, 64, "adagrad")


def handover_tsv(path: Path, batches: int, batch_size: int) -> None:
    """Two trainers, 4 samples each. Table 0 row 5: trainer 0 from the start, trainer 1 from batch 6
    (read right after trainer 0's update: a critical hand-over). Table 1 row 7: trainer 0 in batches
    0-2, trainer 1 in batch 4 only (a background hand-over). Other tables: a few shared rows."""
    half = batch_size // 2
    lines = []
    for b in range(batches):
        for i in range(batch_size):
            first = i < half
            c1 = 5 if first or b >= 6 else 1 + i % 3
            c2 = 7 if (first and b <= 2 and i == 0) or (not first and b == 4) else 2 + (i + b) % 3
            cats = [format(c1, "x"), format(c2, "x")] + [format((i + k) % 3, "x") for k in range(24)]
            ints = [str((i * 5 + b * 3 + k) % 20) for k in range(13)]
            lines.append("\t".join([str((i + b) % 2), *ints, *cats]))
    path.write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_second_trainer_trains_on_the_first_trainers_update(run_job, tmp_path: Path, optimizer: str) -> None:
    data, rows, batch = tmp_path / "handover.tsv", [10] * 26, 8
    handover_tsv(data, 12, batch)
    summary, paths = run_job(
        f"handover-{optimizer}",
        *flags(
            data=f"criteo:{data}",
            table_rows=",".join(map(str, rows)),
            iterations=0,
            trainers=2,
            embedding_servers=2,
            lookahead=4,
            batch_size=batch,
            optimizer=optimizer,
            lr="0.1",
        ),
    )
    assert summary["rows_handed_over"] >= 2
    source = CriteoTSVSource(CriteoConfig(paths=(str(data),), table_rows=tuple(rows)))
    batches = [s for _, s in source.batches(batch)]
    expected = train_reference(
        checkpoint.load(paths["initial"]), batches, MODEL, OptimizerConfig(optimizer, 0.1)
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
        cats = [
            ""
            if (i + k) % 11 == 0
            else format((i * 2654435761 + k * 97) % (1 << 32) % (3 + (i % 5) * 40), "x")
            for k in range(26)
        ]
        lines.append("\t".join([str((i * 7) % 3 % 2), *ints, *cats]))
    data = tmp_path / "day.tsv"
    data.write_text("\n".join(lines) + "\n")
    table_rows = ",".join(map(str, rows))
    _, first = run_job(
        "criteo-a",
        *flags(
            data=f"criteo:{data}",
            table_rows=table_rows,
            iterations=2,
            trainers=1,
            embedding_servers=1,
            optimizer="adagrad",
            batch_size=32,
        ),
    )
    # continue from the first run's checkpoint with a different layout; the reference continues too
    summary, second = run_job(
        "criteo-b",
        *flags(
            data=f"criteo:{data}",
            table_rows=table_rows,
            iterations=0,
            trainers=2,
            embedding_servers=2,
            lookahead=3,
            optimizer="adagrad",
            batch_size=32,
            init_from=str(first["final"]),
        ),
    )
    # the servers started from a model: no row is taken for initial, every one is fetched
    assert summary["rows_fetched_first_per_iteration"] == 0 < summary["rows_fetched_per_iteration"]
    source = CriteoTSVSource(CriteoConfig(paths=(str(data),), table_rows=tuple(rows)))
    batches = [s for _, s in source.batches(32)]
    assert len(batches) == 8
    expected = train_reference(
        checkpoint.load(first["final"]), batches, MODEL, OptimizerConfig("adagrad", 0.1)
    )
    assert_same_model(second["final"], expected)


@pytest.mark.parametrize(("system", "lookup_threads"), [("ideal", 0), ("no-cache", 0), ("no-cache", 2)])
def test_benchmark_baselines_also_match_synchronous_training(
    run_job, system: str, lookup_threads: int
) -> None:
    """The benchmark's ideal (shared-memory table) and no-cache (synchronous fetch, L=1) systems train
    the same model, so comparing their speed with Bagpipe's is fair. No-cache fetches and writes back
    every batch's rows, so it also checks embedding servers that copy lookups off their event loop
    (``--lookup-threads``), with each batch's lookups right behind the write-backs of the one before."""
    iterations = 10
    options = {"lookup_threads": lookup_threads} if lookup_threads else {}
    summary, paths = run_job(
        f"{system}-{lookup_threads}",
        *flags(trainers=2, iterations=iterations, system=system, optimizer="adagrad", lr="0.05", **options),
    )
    if system == "no-cache":
        assert summary["lookahead"]["max"] == 1 and summary["cache_hit_rate"] == 0.0
    # as in bagpipe, the rows used for the first time are computed rather than fetched (or copied)
    assert 0 < summary["rows_fetched_first_per_iteration"] <= summary["rows_fetched_per_iteration"]
    assert_synchronous(paths, iterations, 64, "adagrad")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
@pytest.mark.parametrize(
    ("system", "trainers"), [("bagpipe", 2), ("ideal", 2), ("no-cache", 2), ("bagpipe", 1)]
)
def test_cuda_trainers_match_synchronous_training(run_job, system: str, trainers: int) -> None:
    """CUDA trainers (cache, model and all-reduces on the GPU) train the model the CPU reference does.
    Two trainers on one GPU all-reduce through gloo, as the local launcher sets them up; with a GPU per
    trainer it would be NCCL."""
    lookahead = 8 if system == "bagpipe" else 1
    iterations, batch = 12 + 2 * lookahead, 32 * trainers
    options = {"lookahead": lookahead} if system == "bagpipe" else {"system": system}
    summary, paths = run_job(
        f"cuda-{system}-{trainers}",
        *flags(
            trainers=trainers,
            iterations=iterations,
            batch_size=batch,
            optimizer="adagrad",
            lr="0.05",
            device="cuda",
            **options,
        ),
    )
    assert summary["iterations"] == iterations
    assert_synchronous(paths, iterations, batch, "adagrad")
