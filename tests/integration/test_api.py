"""The Python API: ``bagpipe.run(RunConfig(...))`` trains the job ``bagpipe run`` would, and returns its
typed summary; bad configuration fails before anything starts."""

from __future__ import annotations

from pathlib import Path

import pytest
from bagpipe import ConfigError, RunConfig, RunSummary, run
from bagpipe.core import checkpoint

from tests.integration.test_equivalence import assert_same_model


def test_the_api_trains_the_model_the_command_line_does(run_job, tmp_path: Path) -> None:
    """The same job from Python (keywords) and from the CLI's flags: one model, and the summary typed."""
    summary_cli, paths = run_job(
        "cli", "--iterations", "12", "--optimizer", "adagrad", "--eval-data", "synthetic"
    )
    config = RunConfig(
        scale=0.0005,
        embedding_dim=8,
        batch_size=64,
        bottom_mlp=(16, 8),
        top_mlp=(16, 1),
        iterations=12,
        optimizer="adagrad",
        eval_data="synthetic",
        quiet=True,
        report=False,
        log_level="WARNING",
        run_dir=str(tmp_path / "api"),
        save_initial=str(tmp_path / "api-initial.pt"),
        save_final=str(tmp_path / "api-final.pt"),
    )
    summary = run(config)
    assert isinstance(summary, RunSummary)
    assert summary.iterations == 12 and summary.run_dir == tmp_path / "api"
    assert summary.final_model == tmp_path / "api-final.pt" and summary.final_model.is_file()
    assert summary.report is None and summary.failures_recovered == 0
    assert len(summary.losses) == 12 and summary.final_loss == summary.figures["final_loss"]
    assert summary.samples_per_second > 0 and 0 <= summary.cache_hit_rate <= 1
    assert [e.batches for e in summary.evaluations] == [12] and 0 < summary.evaluations[0].auc < 1
    assert summary.checkpoint_dir == tmp_path / "api" / "checkpoints"
    assert summary.losses == summary_cli["losses"]
    assert_same_model(summary.final_model, checkpoint.load(paths["final"]), tolerance=0.0)


def test_bad_configuration_raises_before_anything_starts(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="batch_size: must be a positive multiple of trainers") as err:
        RunConfig(batch_size=100, trainers=3)
    assert err.value.flag == "--batch-size"
    with pytest.raises(ConfigError, match="no such file") as err:
        run(RunConfig(data=f"criteo:{tmp_path / 'missing.tsv'}", run_dir=str(tmp_path / "r")))
    assert err.value.flag == "--data" and err.value.field == "data"
    assert not (tmp_path / "r").exists()
