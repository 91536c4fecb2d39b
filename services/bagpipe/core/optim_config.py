"""Optimizer settings (``OptimizerConfig``) and the row state they imply, apart from the arithmetic in
``optim.py``: the embedding servers need a row's state width and which of its columns must stay >= 0,
and read them without loading torch."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from bagpipe.flags import flag

if TYPE_CHECKING:
    import torch

OPTIMIZERS = ("sgd", "adagrad", "adam")
# the per-row state entries of each optimizer, in the order of their blocks in a row's state
STATE_KEYS: dict[str, tuple[str, ...]] = {"sgd": (), "adagrad": ("sum",), "adam": ("exp_avg", "exp_avg_sq")}
# state entries that can never be negative (a server refuses a row whose state breaks this)
NON_NEGATIVE = frozenset({"sum", "exp_avg_sq"})
DEFAULT_EPS = {"sgd": 0.0, "adagrad": 1e-10, "adam": 1e-8}


@dataclass(frozen=True)
class OptimizerConfig:
    """One optimizer for dense parameters and embedding rows alike (torch defaults)."""

    name: str = flag(
        "sgd, adagrad or adam, for dense parameters and embeddings alike",
        default="sgd",
        name="optimizer",
        choices=OPTIMIZERS,
    )
    lr: float = flag("learning rate", default=0.1)
    eps: float | None = flag(
        "adagrad/adam epsilon (default: torch's, 1e-10 / 1e-8)",
        default=None,  # (the optimizer's torch default)
        omit=lambda eps, config: eps == DEFAULT_EPS[config.name],
    )
    betas: tuple[float, float] = (0.9, 0.999)
    momentum: float = flag(
        "refused unless 0: lazy momentum on embeddings is not synchronous training", default=0.0
    )
    weight_decay: float = flag(
        "refused unless 0: lazy decay on embeddings is not synchronous training", default=0.0
    )

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise ValueError(f"optimizer: must be one of {', '.join(OPTIMIZERS)}, got {self.name!r}")
        if not self.lr > 0 or not math.isfinite(self.lr):
            raise ValueError(f"lr: must be a finite number > 0, got {self.lr}")
        if self.eps is not None and not (self.eps > 0 and math.isfinite(self.eps)):
            raise ValueError(f"eps: must be a finite number > 0, got {self.eps}")
        if self.eps is None:
            object.__setattr__(self, "eps", DEFAULT_EPS[self.name])
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"betas: each must be in [0, 1), got {self.betas}")
        if self.momentum:
            raise ValueError(
                f"momentum: {self.momentum} is not supported: momentum on rows a batch does not use cannot "
                "be applied lazily and stay equal to synchronous training; use --optimizer adam"
            )
        if self.weight_decay:
            raise ValueError(
                f"weight_decay: {self.weight_decay} is not supported: decay of every row at every step "
                "cannot be applied lazily to the cached rows and stay equal to synchronous training"
            )

    @property
    def state_keys(self) -> tuple[str, ...]:
        return STATE_KEYS[self.name]

    def state_width(self, width: int) -> int:
        """Floats of optimizer state per row of ``width`` floats."""
        return width * len(self.state_keys)

    def non_negative_columns(self, width: int) -> slice:
        """The state columns that must be >= 0 (Adagrad: all; Adam: the second moment)."""
        keys = self.state_keys
        first = next((i for i, k in enumerate(keys) if k in NON_NEGATIVE), len(keys))
        return slice(first * width, len(keys) * width)

    @property
    def epsilon(self) -> float:
        """``eps`` resolved to the optimizer's default."""
        return DEFAULT_EPS[self.name] if self.eps is None else self.eps

    def dense_optimizer(self, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        import torch  # (here, not at the top: servers read this module without loading torch)

        if self.name == "adagrad":
            return torch.optim.Adagrad(params, lr=self.lr, eps=self.epsilon, initial_accumulator_value=0.0)
        if self.name == "adam":
            return torch.optim.Adam(params, lr=self.lr, betas=self.betas, eps=self.epsilon)
        return torch.optim.SGD(params, lr=self.lr)

    def sparse_optimizer(self, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        """The stock optimizer for sparse-gradient tables (the synchronous reference's embeddings)."""
        import torch

        if self.name == "adam":
            return torch.optim.SparseAdam(params, lr=self.lr, betas=self.betas, eps=self.epsilon)
        return self.dense_optimizer(params)
