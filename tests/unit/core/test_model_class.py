"""``--model MODULE:CLASS``: what is refused, and how (a ``ConfigError`` naming ``--model`` and what
failed, as the ``RunConfig`` is built); how a model class is built and called. The classes are this
module's: ``tests.unit.core.test_model_class:Name``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from bagpipe import cli
from bagpipe.core.model import BUILTIN, LINEAR_MODELS, ModelConfig, batch_logits, build_model, row_logits
from bagpipe.core.model_config import first_order, row_width
from bagpipe.flags import ConfigError
from bagpipe.local.run_config import RunConfig
from torch import nn

HERE = "tests.unit.core.test_model_class"


class Fine(nn.Module):
    def __init__(self, num_dense: int, num_tables: int, embedding_dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(num_dense + num_tables * embedding_dim, 1)

    def forward(self, dense: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        return self.linear(torch.cat([dense, embedded.flatten(1)], dim=1)).squeeze(1)


class FineFirstOrder(Fine):
    first_order = True

    def forward(  # type: ignore[override]
        self, dense: torch.Tensor, embedded: torch.Tensor, first_order: torch.Tensor
    ) -> torch.Tensor:
        return super().forward(dense, embedded) + first_order.sum(1)


class NotAModule:
    pass


def a_function(num_dense: int, num_tables: int, embedding_dim: int) -> nn.Module:
    return Fine(num_dense, num_tables, embedding_dim)


class PositionalSizes(nn.Module):
    def __init__(self, sizes: tuple[int, ...]) -> None:
        super().__init__()


class FirstOrderByName(Fine):
    first_order = "wide"


class Frozen(Fine):
    def __init__(self, num_dense: int, num_tables: int, embedding_dim: int) -> None:
        super().__init__(num_dense, num_tables, embedding_dim)
        self.linear.bias.requires_grad_(False)


class NoParameters(nn.Module):
    def __init__(self, num_dense: int, num_tables: int, embedding_dim: int) -> None:
        super().__init__()

    def forward(self, dense: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        return embedded.sum((1, 2))


class KeepsTheColumn(Fine):
    def forward(self, dense: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        return self.linear(torch.cat([dense, embedded.flatten(1)], dim=1))  # [b, 1], not [b]


@pytest.mark.parametrize(
    ("model", "why"),
    [
        ("fm", "must be one of dlrm, wdl, deepfm, dcn or MODULE:CLASS"),
        ("no_such_package.models:Net", "no module named 'no_such_package'"),
        (f"{HERE}:Missing", f"module {HERE} has no attribute 'Missing'"),
        (f"{HERE}:NotAModule", "not a torch.nn.Module subclass (the class NotAModule)"),
        (f"{HERE}:a_function", "not a torch.nn.Module subclass (a function)"),
        (f"{HERE}:PositionalSizes", "cannot be built as PositionalSizes(num_dense=..., num_tables=..., "),
        (f"{HERE}:FirstOrderByName", "first_order must be True or False, got 'wide'"),
        ("__main__:Net", "a class of __main__ (a script, a notebook) cannot be imported"),
    ],
)
def test_a_model_class_that_cannot_be_used_is_refused_naming_the_flag(model: str, why: str) -> None:
    with pytest.raises(ConfigError) as refused:
        RunConfig(model=model)
    assert (refused.value.field, refused.value.flag) == ("model", "--model")
    assert why in refused.value.why


def test_the_command_line_refuses_it_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.parse_run(["--model", "no_such_package.models:Net"])
    assert "argument --model: no_such_package.models:Net: no module named 'no_such_package'" in (
        capsys.readouterr().err
    )


def test_a_module_that_fails_to_import_says_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An import error inside the user's module is its own, not a missing module of the flag's."""
    (tmp_path / "broken_user_models.py").write_text("import no_such_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError) as refused:
        RunConfig(model="broken_user_models:Net")
    assert refused.value.flag == "--model"
    why = "importing broken_user_models failed: ModuleNotFoundError: No module named 'no_such_dependency'"
    assert why in refused.value.why


def test_the_built_in_sizes_are_refused_for_a_model_class() -> None:
    with pytest.raises(ConfigError) as refused:
        RunConfig(model=f"{HERE}:Fine", bottom_mlp=(16, 8))
    assert refused.value.flag == "--bottom-mlp" and "a model class" in refused.value.why
    with pytest.raises(ConfigError, match="deep_mlp: sizes a built-in model"):
        RunConfig(model=f"{HERE}:Fine", deep_mlp=(16,))


def test_first_order_makes_the_rows_one_float_wider() -> None:
    assert row_width(f"{HERE}:Fine", 8) == 8 and not first_order(f"{HERE}:Fine")
    assert row_width(f"{HERE}:FineFirstOrder", 8) == 9
    assert ModelConfig(embedding_dim=8, name=f"{HERE}:FineFirstOrder").row_width == 9
    # the built-ins say it through the same attribute
    assert {name for name, cls in BUILTIN.items() if cls.first_order} == LINEAR_MODELS


def test_a_model_class_is_built_from_the_seed_alone_and_leaves_torchs_generator_alone() -> None:
    config = ModelConfig(embedding_dim=4, num_tables=3, name=f"{HERE}:Fine")
    before = torch.random.get_rng_state()
    a, b, other = build_model(config, seed=7), build_model(config, seed=7), build_model(config, seed=8)
    assert torch.equal(torch.random.get_rng_state(), before)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert not torch.equal(a.linear.weight, other.linear.weight)
    assert config.describe() == {"model": f"{HERE}:Fine"}


@pytest.mark.parametrize(
    ("name", "why"), [("Frozen", "frozen parameters linear.bias"), ("NoParameters", "no parameters")]
)
def test_a_module_bagpipe_cannot_train_is_refused_as_it_is_built(name: str, why: str) -> None:
    with pytest.raises(ValueError, match=f"model: {HERE}:{name}: has {why}"):
        build_model(ModelConfig(num_tables=3, embedding_dim=4, name=f"{HERE}:{name}"))


def test_the_module_gets_the_embeddings_and_the_first_order_weights_apart() -> None:
    """``row_logits`` splits the stored rows [b, t, dim + 1]; ``batch_logits`` gathers them first."""
    gen = torch.Generator().manual_seed(1)
    model = build_model(ModelConfig(num_tables=3, embedding_dim=4, name=f"{HERE}:FineFirstOrder"))
    dense, unique = torch.rand(5, 13, generator=gen), torch.randn(7, 5, generator=gen)
    inverse = torch.randint(0, 7, (5, 3), generator=gen)
    rows = unique[inverse]
    expected = model(dense, rows[..., :4], rows[..., 4])
    assert torch.equal(row_logits(model, dense, rows), expected)
    assert torch.equal(batch_logits(model, dense, unique, inverse), expected)


def test_a_forward_that_does_not_return_one_logit_per_sample_is_named() -> None:
    model = build_model(ModelConfig(num_tables=3, embedding_dim=4, name=f"{HERE}:KeepsTheColumn"))
    with pytest.raises(ValueError, match=r"KeepsTheColumn.forward returned \[5, 1\], expected .* \[5\]"):
        row_logits(model, torch.rand(5, 13), torch.randn(5, 3, 4))


def test_this_module_is_what_the_services_import() -> None:
    assert sys.modules[HERE].Fine is Fine
