"""DLRM as in facebookresearch/dlrm, with embeddings passed in from outside.

The embedding tables do not live in the module: the trainer gathers the rows of a batch from its
cache (the single-process reference from full tables), so the same module serves both and the
dense parameters are all a trainer owns. Linear layers are named ``bottom_mlp.<k>`` and
``top_mlp.<k>`` (the interchange checkpoint's names).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DLRMConfig:
    """Sizes of the dense part. ``bottom_mlp``/``top_mlp`` are the output sizes of each layer."""

    num_dense: int = 13
    num_tables: int = 26
    embedding_dim: int = 16
    bottom_mlp: tuple[int, ...] = (64, 16)
    top_mlp: tuple[int, ...] = (64, 1)

    def __post_init__(self) -> None:
        if self.embedding_dim < 1:
            raise ValueError(f"embedding_dim: must be >= 1, got {self.embedding_dim}")
        if not self.bottom_mlp or min(self.bottom_mlp) < 1:
            raise ValueError(f"bottom_mlp: needs positive layer sizes, got {self.bottom_mlp}")
        if not self.top_mlp or min(self.top_mlp) < 1:
            raise ValueError(f"top_mlp: needs positive layer sizes, got {self.top_mlp}")
        if self.bottom_mlp[-1] != self.embedding_dim:
            raise ValueError(
                f"bottom_mlp: the last size ({self.bottom_mlp[-1]}) must equal embedding_dim "
                f"({self.embedding_dim}) for the dot interaction"
            )
        if self.top_mlp[-1] != 1:
            raise ValueError(f"top_mlp: the last size must be 1 (one logit), got {self.top_mlp[-1]}")

    @property
    def interaction_size(self) -> int:
        features = self.num_tables + 1
        return features * (features - 1) // 2 + self.embedding_dim


def _mlp(in_size: int, sizes: tuple[int, ...]) -> nn.ModuleList:
    layers = nn.ModuleList()
    for size in sizes:
        layers.append(nn.Linear(in_size, size))
        in_size = size
    return layers


class DLRM(nn.Module):
    """Bottom MLP, dot interaction (strict lower triangle), top MLP; returns logits."""

    def __init__(self, config: DLRMConfig, seed: int = 0) -> None:
        super().__init__()
        self.config = config
        self.bottom_mlp = _mlp(config.num_dense, config.bottom_mlp)
        self.top_mlp = _mlp(config.interaction_size, config.top_mlp)
        features = config.num_tables + 1
        rows, cols = torch.tril_indices(features, features, offset=-1)
        self.register_buffer("_tril_rows", rows, persistent=False)
        self.register_buffer("_tril_cols", cols, persistent=False)
        self.reset_parameters(seed)

    def reset_parameters(self, seed: int) -> None:
        """The reference DLRM initialisation, from ``seed`` alone."""
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for layer in [*self.bottom_mlp, *self.top_mlp]:
                assert isinstance(layer, nn.Linear)
                fan_out, fan_in = layer.weight.shape
                layer.weight.normal_(0.0, (2.0 / (fan_in + fan_out)) ** 0.5, generator=gen)
                layer.bias.normal_(0.0, (1.0 / fan_out) ** 0.5, generator=gen)

    def forward(self, dense: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        """dense [b, num_dense], embedded [b, num_tables, dim] -> logits [b]."""
        x = dense
        for layer in self.bottom_mlp:
            x = F.relu(layer(x))
        features = torch.cat([x.unsqueeze(1), embedded], dim=1)
        dots = torch.bmm(features, features.transpose(1, 2))
        z = torch.cat([x, dots[:, self._tril_rows, self._tril_cols]], dim=1)
        for k, layer in enumerate(self.top_mlp):
            z = layer(z)
            if k < len(self.top_mlp) - 1:
                z = F.relu(z)
        return z.squeeze(1)


def batch_loss(logits: torch.Tensor, labels: torch.Tensor, global_batch_size: int) -> torch.Tensor:
    """This slice's share of the global batch's mean binary cross-entropy.

    Summing it over the trainers' slices gives the mean over the global batch, so summing gradients
    across trainers gives exactly the single-process gradient.
    """
    return F.binary_cross_entropy_with_logits(logits, labels, reduction="sum") / global_batch_size
