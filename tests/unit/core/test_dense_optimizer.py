"""The trainer's dense optimizer on the CPU (``core.optim.DenseOptimizer``) must equal torch.optim to the
bit, step after step, its checkpoint entries included, and must not load ``torch._dynamo``."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from bagpipe.core.optim import DenseOptimizer, OptimizerConfig, restore_state, saved_state, steps_taken

CONFIGS = [
    OptimizerConfig("sgd", 0.3),
    OptimizerConfig("adagrad", 0.05),
    OptimizerConfig("adagrad", 0.05, eps=1e-3),
    OptimizerConfig("adam", 0.01),
    OptimizerConfig("adam", 0.002, betas=(0.5, 0.9), eps=1e-6),
]


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(13, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))


def _train(model: torch.nn.Module, opt: object, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(64, 13, generator=g), torch.randn(64, 1, generator=g)
        opt.zero_grad(set_to_none=False)  # type: ignore[attr-defined]
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()  # type: ignore[attr-defined]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c.name}-{c.lr}-{c.epsilon}")
def test_steps_equal_torch_optim_bit_for_bit(config: OptimizerConfig) -> None:
    ours, theirs = _model(1), _model(1)
    mine = DenseOptimizer(config, list(ours.parameters()))
    stock = config.dense_optimizer(list(theirs.parameters()))
    _train(ours, mine, 25, seed=2)
    _train(theirs, stock, 25, seed=2)
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        assert torch.equal(a, b), f"{config.name}: {name} differs by {(a - b).abs().max().item()}"
    mine_saved = saved_state(mine, dict(ours.named_parameters()))
    stock_saved = saved_state(stock, dict(theirs.named_parameters()))
    assert mine_saved.keys() == stock_saved.keys()
    for name, entries in stock_saved.items():
        assert mine_saved[name].keys() == entries.keys(), name
        for k, v in entries.items():
            assert torch.equal(torch.as_tensor(mine_saved[name][k]), torch.as_tensor(v)), (name, k)
    assert steps_taken(mine) == steps_taken(stock) == (25 if config.name == "adam" else 0)


@pytest.mark.parametrize("name", ["adagrad", "adam"])
def test_a_restored_state_goes_on_as_torch_optim_does(name: str) -> None:
    """A checkpoint saved by torch.optim, restored into ours (and the other way round), continues
    identically: the trainer resumes from checkpoints the reference wrote, and vice versa."""
    config = OptimizerConfig(name, 0.02)
    first = _model(3)
    stock = config.dense_optimizer(list(first.parameters()))
    _train(first, stock, 7, seed=4)
    saved = saved_state(stock, dict(first.named_parameters()))
    weights = {k: v.detach().clone() for k, v in first.state_dict().items()}

    ours, theirs = _model(5), _model(5)
    ours.load_state_dict(weights)
    theirs.load_state_dict(weights)
    mine = DenseOptimizer(config, list(ours.parameters()))
    again = config.dense_optimizer(list(theirs.parameters()))
    restore_state(mine, dict(ours.named_parameters()), saved)
    restore_state(again, dict(theirs.named_parameters()), saved)
    assert steps_taken(mine) == steps_taken(again)
    _train(ours, mine, 6, seed=6)
    _train(theirs, again, 6, seed=6)
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert torch.equal(a, b)
    # and ours saves what torch.optim restores
    back = _model(7)
    back.load_state_dict({k: v.detach().clone() for k, v in ours.state_dict().items()})
    restored = config.dense_optimizer(list(back.parameters()))
    restore_state(restored, dict(back.named_parameters()), saved_state(mine, dict(ours.named_parameters())))
    _train(ours, mine, 3, seed=8)
    _train(back, restored, 3, seed=8)
    for a, b in zip(ours.parameters(), back.parameters(), strict=True):
        assert torch.equal(a, b)


def test_zero_grad_and_parameters_without_gradients() -> None:
    """``zero_grad(set_to_none=False)`` keeps zeroed gradients; a parameter without one is skipped, as
    torch.optim skips it (Adam makes no state for it)."""
    model = torch.nn.Linear(3, 2)
    frozen = torch.nn.Parameter(torch.ones(4))
    opt = DenseOptimizer(OptimizerConfig("adam", 0.1), [*model.parameters(), frozen])
    model(torch.ones(5, 3)).sum().backward()
    opt.step()
    assert frozen not in opt.state and torch.equal(frozen, torch.ones(4))
    opt.zero_grad(set_to_none=False)
    assert model.weight.grad is not None and not model.weight.grad.any()
    opt.zero_grad()
    assert model.weight.grad is None


def test_the_dense_optimizer_does_not_load_torch_dynamo() -> None:
    """What it is for: torch.optim imports ``torch._dynamo`` (over a second) on first use."""
    code = (
        "import sys, torch\n"
        "from bagpipe.core.optim import DenseOptimizer, OptimizerConfig\n"
        "for name in ('sgd', 'adagrad', 'adam'):\n"
        "    m = torch.nn.Linear(3, 1)\n"
        "    o = DenseOptimizer(OptimizerConfig(name, 0.1), list(m.parameters()))\n"
        "    m(torch.ones(2, 3)).sum().backward(); o.step(); o.zero_grad(set_to_none=False)\n"
        "print(sorted(k for k in sys.modules if k.startswith('torch._dynamo')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
