"""The run summary's steady state: the warm-up (the first plans, lookups, compiling) told apart by one rule
and reported on its own, so that the time per iteration and its stages are the run's steady ones."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from bagpipe.local.run_config import RunConfig
from bagpipe.local.summary import format_summary, steady_state, summarize, warm_up
from bagpipe.trainer.metrics import STAGES


def test_the_warm_up_is_the_slow_start_and_at_least_the_first_batch() -> None:
    steady = [0.02] * 200
    assert warm_up([3.0, 0.6, 0.2, *steady]) == 3  # start-up, the first plans, compiling
    assert warm_up([0.021, *steady]) == 1  # (no slow start: the first batch alone)
    assert warm_up([3.0, *steady[:50], 0.5, *steady[:50]]) == 1  # a slow batch later is not warm-up
    assert warm_up([0.5]) == 0 and warm_up([]) == 0


def log(batches: list[int], data_wait: list[float], forward: list[float]) -> dict[str, list[float]]:
    """A trainer's per-iteration log as the summary reads it: two stages that take time, the rest none."""
    cols: dict[str, list[float]] = {
        "batch": [float(b) for b in batches],
        "iteration_seconds": [w + f for w, f in zip(data_wait, forward, strict=True)],
    }
    for stage in STAGES:
        cols[f"{stage}_seconds"] = [0.0] * len(batches)
    cols["data_wait_seconds"] = list(data_wait)
    cols["forward_seconds"] = list(forward)
    return cols


def test_the_steady_state_leaves_out_the_first_plans_and_compiling() -> None:
    # batch 0 waits for the first plan and compiles, batch 1 compiles the rest; then 12 ms a batch
    fresh = log(list(range(20)), [0.25, 0.001] + [0.0] * 18, [0.5, 0.1] + [0.012] * 18)
    figures = steady_state([fresh])
    assert figures is not None
    steady, warm = figures["steady_state"], figures["warm_up"]
    assert steady["iterations"] == 18
    assert steady["seconds_per_iteration"] == pytest.approx(0.012)
    assert steady["stage_seconds_per_iteration"]["data_wait"] == 0.0
    assert steady["stage_seconds_per_iteration"]["forward"] == pytest.approx(0.012)
    assert warm == {"iterations": 2, "seconds": pytest.approx(0.851)}
    # what the whole-run mean would have said instead
    assert sum(fresh["iteration_seconds"]) / 20 == pytest.approx(0.05335)


def test_each_generation_after_a_recovery_warms_up_again() -> None:
    """Rank 0 trained batches 0-11, the job failed and resumed from checkpoint 5: the replay is a stretch
    of its own, whose first iteration is warm-up too."""
    first = log(list(range(12)), [0.0] * 12, [0.4] + [0.01] * 11)
    replay = log(list(range(5, 17)), [0.0] * 12, [0.3] + [0.01] * 11)
    both = {k: first[k] + replay[k] for k in first}
    figures = steady_state([both])
    assert figures is not None
    assert figures["warm_up"] == {"iterations": 2, "seconds": pytest.approx(0.7)}
    assert figures["steady_state"]["iterations"] == 22
    assert figures["steady_state"]["seconds_per_iteration"] == pytest.approx(0.01)


def test_the_job_wide_figures_are_the_slowest_trainer_and_the_mean_of_the_stages() -> None:
    quick = log(list(range(10)), [0.0] * 10, [0.3] + [0.01] * 9)
    slow = log(list(range(10)), [0.5] + [0.01] * 9, [0.3] + [0.01] * 9)  # waits 10 ms for each plan
    figures = steady_state([quick, slow, {}])  # (a trainer with no row yet counts for nothing)
    assert figures is not None
    steady = figures["steady_state"]
    assert steady["seconds_per_iteration"] == pytest.approx(0.02)
    assert steady["stage_seconds_per_iteration"]["data_wait"] == pytest.approx(0.005)
    assert steady["stage_seconds_per_iteration"]["forward"] == pytest.approx(0.01)
    assert figures["warm_up"] == {"iterations": 1, "seconds": pytest.approx(0.8)}
    assert steady_state([]) is None and steady_state([{}]) is None


def summary(**figures: Any) -> dict[str, Any]:
    """A summary as ``summarize`` makes it, with every figure the printed lines read."""
    base: dict[str, Any] = {
        "run_dir": "runs/x",
        "iterations": 20,
        "trainers": 1,
        "embedding_servers": 2,
        "batch_size": 64,
        "lookahead": {"min": 1, "max": 4, "mean": 3.5, "requested": None},
        "cache_mode": "lrpp",
        "sync": "delayed",
        "cache_rows": None,
        "cache_peak_occupancy_rows": 10,
        "cache_capacity_rows": 1024,
        "samples_per_second": 1000.0,
        "seconds_per_iteration": 0.0327,
        "stage_seconds_per_iteration": {s: (0.00708 if s == "data_wait" else 0.0) for s in STAGES},
        "cache_hit_rate": 0.5,
        "rows_per_iteration": 1.0,
        "rows_fetched_per_iteration": 1.0,
        "rows_fetched_first_per_iteration": 0.0,
        "rows_fetched_initial_per_iteration": 0.0,
        "rows_written_back_per_iteration": 1.0,
        "lookup_calls_per_iteration": 1.0,
        "write_back_calls_per_iteration": 1.0,
        "rows_synced_critical_per_iteration": 0.0,
        "rows_synced_background_per_iteration": 0.0,
        "rows_private_per_iteration": 0.0,
        "first_loss": None,
    }
    return {**base, **figures}


def test_the_printed_summary_shows_the_steady_state_and_the_warm_up_on_its_own_line() -> None:
    steady = {
        "iterations": 18,
        "seconds_per_iteration": 0.0129,
        "stage_seconds_per_iteration": {s: (0.00003 if s == "data_wait" else 0.0) for s in STAGES},
    }
    lines = format_summary(
        summary(steady_state=steady, warm_up={"iterations": 2, "seconds": 0.35})
    ).splitlines()
    assert (
        "time per iteration   12.9 ms in the steady state (18 iterations; 32.7 ms over the whole run, "
        "warm-up and checkpoints included)"
    ) in lines
    assert "  data_wait              0.03 ms" in lines
    assert (
        "warm-up              2 iteration(s), 350.0 ms in all (the first plans, lookups and compiling; "
        "not in the steady state)"
    ) in lines
    # without the per-iteration logs: the whole run's figures, as before
    lines = format_summary(summary(steady_state=None, warm_up=None)).splitlines()
    assert "time per iteration   32.7 ms" in lines and "  data_wait              7.08 ms" in lines
    assert not [line for line in lines if line.startswith("warm-up")]


def test_summarize_reads_the_steady_state_from_the_trainers_logs(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics"
    metrics.mkdir()
    cols = log(list(range(10)), [0.2] + [0.0] * 9, [0.3] + [0.01] * 9)
    lines = [",".join(cols), *(",".join(str(cols[k][i]) for k in cols) for i in range(10))]
    (metrics / "trainer-0.csv").write_text("\n".join(lines) + "\n")
    stats = {
        "seconds": 1.0,
        "iterations": 10,
        "stage_seconds_per_iteration": dict.fromkeys(STAGES, 0.0),
        "losses": [],
        "lookahead": {"min": 1, "max": 1, "mean": 1.0},
        "cache_peak_occupancy_rows": 0,
        "cache_capacity_rows": 0,
        "samples_per_second": 1.0,
        "cache_hit_rate": 1.0,
        "unique_rows_per_iteration": 0.0,
        "rows_prefetched_per_iteration": 0.0,
        "rows_private_per_iteration": 0.0,
        "rows_synced_critical_per_iteration": 0.0,
        "rows_synced_background_per_iteration": 0.0,
        "rows_handed_over": 0,
        "rows_written_back_per_iteration": 0.0,
    }
    figures = summarize([stats], RunConfig(), tmp_path)
    assert figures["warm_up"] == {"iterations": 1, "seconds": pytest.approx(0.5)}
    assert figures["steady_state"]["seconds_per_iteration"] == pytest.approx(0.01)
    assert figures["seconds_per_iteration"] == 0.1  # (the whole run's, kept)
