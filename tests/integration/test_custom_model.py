"""A model class of the user's (``--model MODULE:CLASS``) trains exactly like single-process synchronous
training, as the built-in models do.

The classes below are the user's: every trainer and embedding server imports them by name,
``tests.integration.test_custom_model:GatedTower``. The launcher's processes inherit its environment, so
the tests put the repository root on ``PYTHONPATH`` (as a user installs the module, or sets the
variable) instead of relying on the working directory. Bagpipe keeps the embedding rows (with the
first-order weight as one more column for ``first_order = True``); the reference (tests/reference.py)
calls the same class with rows from stock ``nn.Embedding`` tables.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from bagpipe.cli import parse_run
from bagpipe.core import checkpoint
from bagpipe.core.model import ModelConfig
from bagpipe.core.optim import OptimizerConfig
from bagpipe.local.launcher import run
from bagpipe.local.run_config import RunConfig
from torch import nn

from tests.integration.conftest import TINY, adam_eps, flags
from tests.integration.test_equivalence import assert_same_model, synthetic_batches
from tests.reference import train_reference

ROOT = Path(__file__).resolve().parents[2]
HERE = "tests.integration.test_custom_model"


class GatedTower(nn.Module):
    """The dense features projected to the embedding size gate each table's embedding (a sigmoid of
    their dot product); an MLP on [projection, gated embeddings] gives the logit. Default torch
    initialisation: Bagpipe seeds it."""

    def __init__(self, num_dense: int, num_tables: int, embedding_dim: int) -> None:
        super().__init__()
        self.project = nn.Linear(num_dense, embedding_dim)
        self.mlp = nn.Sequential(nn.Linear((num_tables + 1) * embedding_dim, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, dense: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        projected = torch.tanh(self.project(dense))  # [b, dim]
        gates = torch.sigmoid((embedded * projected.unsqueeze(1)).sum(2, keepdim=True))  # [b, tables, 1]
        return self.mlp(torch.cat([projected, (embedded * gates).flatten(1)], dim=1)).squeeze(1)


class WideGatedTower(GatedTower):
    """``GatedTower`` plus a wide part: the sum of the categories' first-order weights."""

    first_order = True

    def forward(  # type: ignore[override]
        self, dense: torch.Tensor, embedded: torch.Tensor, first_order: torch.Tensor
    ) -> torch.Tensor:
        return super().forward(dense, embedded) + first_order.sum(1)


@pytest.fixture(autouse=True)
def importable(monkeypatch: pytest.MonkeyPatch) -> None:
    """The services find ``tests.…`` through PYTHONPATH, whatever the working directory."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))


def paths_of(tmp_path: Path, name: str) -> dict[str, Path]:
    return {"initial": tmp_path / f"{name}-initial.pt", "final": tmp_path / f"{name}-final.pt"}


def assert_synchronous(
    paths: dict[str, Path], spec: str, iterations: int, batch: int, optim: OptimizerConfig
) -> dict[str, float]:
    """The final model is the reference's, trained from the run's initial checkpoint on its batches
    (``assert_same_model``); returns the differences, tensor by tensor."""
    initial = checkpoint.load(paths["initial"])
    model = ModelConfig(embedding_dim=8, name=spec)
    expected = train_reference(initial, synthetic_batches(iterations, batch), model, optim)
    assert_same_model(paths["final"], expected)
    final = checkpoint.load(paths["final"])
    assert final["meta"]["model"] == spec
    assert ("linear" in final) == model.linear == ("linear" in expected)
    return checkpoint.max_abs_difference(final, expected)


def test_a_model_class_from_the_command_line_matches_synchronous_training(tmp_path: Path) -> None:
    """``bagpipe run --model MODULE:CLASS``: 2 trainers, 2 servers, LRPP with delayed sync, L=8."""
    spec, iterations, batch = f"{HERE}:GatedTower", 20, 64
    paths = paths_of(tmp_path, "gated")
    argv = [
        *TINY,
        *flags(
            model=spec,
            optimizer="adagrad",
            lr=0.05,
            trainers=2,
            embedding_servers=2,
            lookahead=8,
            iterations=iterations,
            batch_size=batch,
        ),
        "--no-report",
        *flags(run_dir=tmp_path / "gated", save_initial=paths["initial"], save_final=paths["final"]),
    ]
    summary = run(parse_run(argv))
    assert summary["iterations"] == iterations and summary["rows_handed_over"] > 0
    diffs = assert_synchronous(paths, spec, iterations, batch, OptimizerConfig("adagrad", 0.05))
    print(f"GatedTower: max difference to the reference {max(diffs.values()):.3g}")


def test_a_model_class_with_first_order_weights_matches_synchronous_training(tmp_path: Path) -> None:
    """``RunConfig(model="MODULE:CLASS")`` of a class with ``first_order = True``: rows one float wider,
    the first-order weights handed to the module apart, with Adam's state for them."""
    spec, iterations, batch = f"{HERE}:WideGatedTower", 20, 64
    paths = paths_of(tmp_path, "wide")
    config = RunConfig(
        model=spec,
        scale=0.0005,
        embedding_dim=8,
        optimizer="adam",
        lr=0.01,
        **adam_eps("adam"),
        trainers=2,
        embedding_servers=2,
        data_processors=1,
        lookahead=8,
        iterations=iterations,
        batch_size=batch,
        quiet=True,
        report=False,
        log_level="WARNING",
        run_dir=str(tmp_path / "wide"),
        save_initial=str(paths["initial"]),
        save_final=str(paths["final"]),
    )
    summary = run(config)
    assert summary["iterations"] == iterations and summary["rows_handed_over"] > 0
    optim = OptimizerConfig("adam", 0.01, **adam_eps("adam"))
    diffs = assert_synchronous(paths, spec, iterations, batch, optim)
    print(f"WideGatedTower: max difference to the reference {max(diffs.values()):.3g}")
