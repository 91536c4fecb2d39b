"""Optimizers for embedding rows that live outside any nn.Parameter, with torch.optim semantics.

A row's optimizer state (Adagrad's sum of squares) has the row's shape and travels with it between
embedding server and cache; ``state_width`` tells how many floats per row that is. The arithmetic
mirrors ``torch.optim.SGD``/``Adagrad`` on sparse gradients so results match them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

OPTIMIZERS = ("sgd", "adagrad")


@dataclass(frozen=True)
class OptimizerConfig:
    """One optimizer for dense parameters and embedding rows alike (torch defaults)."""

    name: str = "sgd"
    lr: float = 0.1
    eps: float = 1e-10

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise ValueError(f"optimizer: must be one of {', '.join(OPTIMIZERS)}, got {self.name!r}")
        if not self.lr > 0:
            raise ValueError(f"lr: must be > 0, got {self.lr}")

    def state_width(self, dim: int) -> int:
        return dim if self.name == "adagrad" else 0

    def dense_optimizer(self, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        if self.name == "adagrad":
            return torch.optim.Adagrad(params, lr=self.lr, eps=self.eps, initial_accumulator_value=0.0)
        return torch.optim.SGD(params, lr=self.lr)


def apply_rows(
    config: OptimizerConfig,
    weights: torch.Tensor,
    state: torch.Tensor,
    index: torch.Tensor,
    grad: torch.Tensor,
) -> None:
    """Updates ``weights[index]`` (and ``state[index]``) in place from the summed gradient ``grad``.

    ``index`` holds distinct row positions; ``grad`` is [len(index), dim].
    """
    if config.name == "sgd":
        weights.index_add_(0, index, grad, alpha=-config.lr)
        return
    total = state.index_select(0, index).addcmul_(grad, grad)
    state.index_copy_(0, index, total)
    weights.index_add_(0, index, grad / total.sqrt().add_(config.eps), alpha=-config.lr)


def saved_sums(optimizer: torch.optim.Optimizer, params: Mapping[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """The checkpoint's optimizer entries, ``{name: {"sum": tensor}}`` (empty for SGD), on the CPU."""
    return {
        name: {"sum": optimizer.state[p]["sum"].detach().cpu().clone()}
        for name, p in params.items()
        if "sum" in optimizer.state.get(p, {})
    }


def restore_sums(
    optimizer: torch.optim.Optimizer, params: Mapping[str, torch.Tensor], saved: Mapping[str, Any]
) -> None:
    """Seeds Adagrad's sums from a checkpoint's entries so training resumes exactly."""
    for name, p in params.items():
        if "sum" in saved.get(name, {}):
            optimizer.state[p]["sum"] = saved[name]["sum"].clone().to(p.device)
            optimizer.state[p]["step"] = torch.tensor(0.0)
