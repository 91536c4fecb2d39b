"""Which of a trainer's failures are deterministic (a restart would meet them again: the job fails at once)
and which are recovered from, and the one line each deterministic one is told in."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest
import torch
from bagpipe.config_args import Coordination
from bagpipe.core.model import ModelConfig
from bagpipe.core.optim import OptimizerConfig
from bagpipe.trainer.cache import EmbeddingCache
from bagpipe.trainer.config import TrainerConfig
from bagpipe.trainer.faults import Deterministic, deterministic, finite_loss, model_step
from bagpipe.trainer.pipeline import Pipeline

from tests.unit.trainer.test_checkpoint_errors import Refused

REFUSAL = "rows: key 3922: value -6.909547e+08 (must be at most 1e+06 in absolute value (--max-abs-value))"


def _config(tmp_path: Path, transform: str = "none", lr: float = 0.1) -> TrainerConfig:
    """A trainer of csv data with two dense columns (``transform``) and one table."""
    (tmp_path / "d.csv").write_text("label,price,age,shop\n1,2.5,30.0,a\n")
    (tmp_path / "s.json").write_text(
        json.dumps(
            {
                "columns": [
                    {"name": "label", "role": "label"},
                    {"name": "price", "role": "dense", "transform": transform},
                    {"name": "age", "role": "dense"},
                    {"name": "shop", "role": "categorical"},
                ]
            }
        )
    )
    return TrainerConfig(
        0,
        1,
        "env://",
        ModelConfig(num_dense=2, num_tables=1),
        OptimizerConfig(lr=lr),
        (5,),
        0,
        None,
        None,
        None,
        "cpu",
        Coordination(),
        data=f"csv:{tmp_path / 'd.csv'}",
        schema=str(tmp_path / "s.json"),
    )


def _through_the_pipeline(error: BaseException, config: TrainerConfig) -> RuntimeError:
    """What the training thread raises once the writer thread met ``error``."""
    pipeline = Pipeline(config, EmbeddingCache(2, 0, torch.device("cpu")), None, [], 0)  # type: ignore[arg-type]
    pipeline.fail(error)
    with pytest.raises(RuntimeError) as raised:
        pipeline.raise_error()
    return raised.value


def test_a_refused_write_back_is_a_diverged_model_naming_what_to_change(tmp_path: Path) -> None:
    config = _config(tmp_path)
    error = _through_the_pipeline(Refused(grpc.StatusCode.INVALID_ARGUMENT, REFUSAL), config)
    assert str(error) == f"the trainer's MainThread thread failed: INVALID_ARGUMENT: {REFUSAL}"
    assert deterministic(error, config) == (
        f"the model diverged: an embedding server refused a row written back: {REFUSAL}; lower --lr "
        "(now 0.1), or give the dense columns taken as they are (price) transform: log1p in a --schema"
    )
    # (every dense column already log1p: the rate is what is left to change)
    assert deterministic(error, _config(tmp_path, "log1p", lr=2.0)) == (
        f"the model diverged: an embedding server refused a row written back: {REFUSAL}; lower --lr (now 2)"
    )


@pytest.mark.parametrize(
    "error",
    [
        Refused(grpc.StatusCode.UNAVAILABLE, "connection refused"),
        Refused(grpc.StatusCode.ABORTED, "generation 3 is over"),
        Refused(grpc.StatusCode.INVALID_ARGUMENT, "generation: not this job's"),
        RuntimeError("[gloo] Connection closed by peer"),
        TimeoutError("no shard map in Redis after 120s"),
    ],
)
def test_what_another_process_may_have_caused_is_recovered_from(tmp_path: Path, error: Exception) -> None:
    config = _config(tmp_path)
    assert deterministic(error, config) is None
    assert deterministic(_through_the_pipeline(error, config), config) is None


def test_a_loss_that_is_not_finite_is_a_diverged_model(tmp_path: Path) -> None:
    config = _config(tmp_path)
    assert finite_loss(4, torch.tensor(0.25), config) == 0.25
    for value in (float("nan"), float("inf")):
        with pytest.raises(Deterministic) as raised:
            finite_loss(4, torch.tensor(value), config)
        assert deterministic(raised.value, config) == (
            f"batch 4: the model diverged: the loss is {value}; lower --lr (now 0.1), or give the dense "
            "columns taken as they are (price) transform: log1p in a --schema"
        )


def test_a_batch_the_model_cannot_take_is_deterministic_and_memory_is_not(tmp_path: Path) -> None:
    layer = torch.nn.Linear(3, 1)
    with pytest.raises(Deterministic) as raised, model_step(7):
        layer(torch.zeros(2, 4))
    assert str(raised.value).startswith(
        "batch 7: the model cannot take the batch (RuntimeError: mat1 and mat2 shapes cannot be multiplied"
    )
    assert "\n" not in str(raised.value)
    with pytest.raises(torch.OutOfMemoryError), model_step(7):
        raise torch.OutOfMemoryError("CUDA out of memory")
