"""Plain single-process synchronous training: the result every Bagpipe run must reproduce.

Full embedding tables as ``nn.Embedding(sparse=True)`` (and, for the models with first-order weights —
W&D, DeepFM, a model class with ``first_order = True`` — one ``nn.Embedding(rows, 1, sparse=True)`` per
table for them), the whole global batch in one step, mean loss, and the stock ``torch.optim`` optimizers
(``SparseAdam`` for the tables under Adam) — deliberately none of Bagpipe's cache, planner, row layout or
row optimizer, so that agreement between the two is evidence and not an echo. The model is called as its
interface says (core/model.py): ``model(dense, embedded)``, or ``model(dense, embedded, first_order)``
with the first-order weights from their own tables.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from bagpipe.core.model import ModelConfig, batch_loss, build_model
from bagpipe.core.optim import OptimizerConfig, restore_state, saved_state
from torch import nn


def train_reference(
    initial: dict[str, Any],
    batches: Iterable[Any],
    model_config: ModelConfig,
    optim_config: OptimizerConfig,
) -> dict[str, Any]:
    """Trains from an interchange checkpoint on ``batches`` (objects with ``dense``, ``sparse``,
    ``labels`` numpy arrays) and returns the final interchange checkpoint."""
    model = build_model(model_config)
    model.load_state_dict({k: v.clone() for k, v in initial["dense"].items()})
    sections = ["embeddings"] + (["linear"] if model_config.linear else [])
    tables = {
        section: {
            str(t): nn.Embedding.from_pretrained(initial[section][str(t)].clone(), freeze=False, sparse=True)
            for t in range(model_config.num_tables)
        }
        for section in sections
    }
    dense_opt = optim_config.dense_optimizer(list(model.parameters()))
    named = {section: {t: e.weight for t, e in tables[section].items()} for section in sections}
    emb_opt = optim_config.sparse_optimizer([w for section in sections for w in named[section].values()])
    saved = initial.get("optimizer") or {}
    named_dense = dict(model.named_parameters())
    restore_state(dense_opt, named_dense, saved.get("dense", {}))
    for section in sections:
        restore_state(emb_opt, named[section], saved.get(section, {}))

    steps = 0
    for batch in batches:
        dense = torch.from_numpy(batch.dense)
        labels = torch.from_numpy(batch.labels)
        sparse = torch.from_numpy(batch.sparse)
        looked_up = [
            torch.stack([table(sparse[:, int(t)]) for t, table in tables[section].items()], dim=1)
            for section in sections
        ]  # [b, tables, dim], and [b, tables, 1] for the first-order weights
        inputs = [looked_up[0]] + [first.squeeze(2) for first in looked_up[1:]]
        loss = batch_loss(model(dense, *inputs), labels, len(labels))
        dense_opt.zero_grad()
        emb_opt.zero_grad()
        loss.backward()
        dense_opt.step()
        emb_opt.step()
        steps += 1

    out: dict[str, Any] = {"dense": {k: v.detach().clone() for k, v in model.state_dict().items()}}
    for section in sections:
        out[section] = {t: e.weight.detach().clone() for t, e in tables[section].items()}
    out["optimizer"] = {
        "name": optim_config.name,
        "lr": optim_config.lr,
        "dense": saved_state(dense_opt, named_dense),
        **{section: saved_state(emb_opt, named[section]) for section in sections},
    }
    out["meta"] = {"trainer": "reference", "steps": steps + int(initial.get("meta", {}).get("steps", 0))}
    return out
