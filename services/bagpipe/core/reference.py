"""Plain single-process synchronous training: the result every Bagpipe run must reproduce.

Full embedding tables as ``nn.Embedding(sparse=True)``, the whole global batch in one step, mean
loss, and the stock ``torch.optim`` optimizers — deliberately none of Bagpipe's cache, planner or
row optimizer, so that agreement between the two is evidence and not an echo.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from bagpipe.core.model import DLRM, DLRMConfig, batch_loss
from bagpipe.core.optim import OptimizerConfig, restore_sums, saved_sums


def train_reference(
    initial: dict[str, Any],
    batches: Iterable[Any],
    model_config: DLRMConfig,
    optim_config: OptimizerConfig,
) -> dict[str, Any]:
    """Trains from an interchange checkpoint on ``batches`` (objects with ``dense``, ``sparse``,
    ``labels`` numpy arrays) and returns the final interchange checkpoint."""
    model = DLRM(model_config)
    model.load_state_dict({k: v.clone() for k, v in initial["dense"].items()})
    tables = [
        nn.Embedding.from_pretrained(initial["embeddings"][str(t)].clone(), freeze=False, sparse=True)
        for t in range(model_config.num_tables)
    ]
    dense_opt = optim_config.dense_optimizer(list(model.parameters()))
    emb_params = [t.weight for t in tables]
    emb_opt: torch.optim.Optimizer
    if optim_config.name == "adagrad":
        emb_opt = torch.optim.Adagrad(emb_params, lr=optim_config.lr, eps=optim_config.eps)
    else:
        emb_opt = torch.optim.SGD(emb_params, lr=optim_config.lr)
    named_dense = dict(model.named_parameters())
    named_tables = {str(t): tab.weight for t, tab in enumerate(tables)}
    saved = initial.get("optimizer") or {}
    restore_sums(dense_opt, named_dense, saved.get("dense", {}))
    restore_sums(emb_opt, named_tables, saved.get("embeddings", {}))

    steps = 0
    for batch in batches:
        dense = torch.from_numpy(batch.dense)
        labels = torch.from_numpy(batch.labels)
        sparse = torch.from_numpy(batch.sparse)
        embedded = torch.stack([tables[t](sparse[:, t]) for t in range(len(tables))], dim=1)
        loss = batch_loss(model(dense, embedded), labels, len(labels))
        dense_opt.zero_grad()
        emb_opt.zero_grad()
        loss.backward()
        dense_opt.step()
        emb_opt.step()
        steps += 1

    return {
        "dense": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "embeddings": {str(t): tab.weight.detach().clone() for t, tab in enumerate(tables)},
        "optimizer": {
            "name": optim_config.name,
            "lr": optim_config.lr,
            "dense": saved_sums(dense_opt, named_dense),
            "embeddings": saved_sums(emb_opt, named_tables),
        },
        "meta": {"trainer": "reference", "steps": steps + int(initial.get("meta", {}).get("steps", 0))},
    }

