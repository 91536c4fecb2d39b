"""The interchange checkpoint: one ``torch.save`` file plain PyTorch can load.

``{"dense": {name: tensor}, "embeddings": {"<table>": FloatTensor[rows, dim]},
"linear": {"<table>": FloatTensor[rows, 1]},                      (W&D and DeepFM only)
"optimizer": {"name", "lr", "dense": {name: {...}}, "embeddings": {"<table>": {...}},
              "linear": {"<table>": {...}}},
"meta": {...}}``.

Optimizer entries are torch's own state of that parameter: Adagrad ``{"sum"}`` as in
``torch.optim.Adagrad``; Adam ``{"step", "exp_avg", "exp_avg_sq"}`` as in ``torch.optim.Adam`` (dense) and
``torch.optim.SparseAdam`` (tables, whose ``step`` is the global step count); nothing for SGD. So each
table loads into ``nn.Embedding`` and its state into the stock optimizer's ``state_dict``.

Servers and caches keep a category's embedding vector and first-order weight as one row
(core/model.py); ``table_rows``/``table_state`` join the two sections into that row, ``put_table``
splits it again.

``--init-from`` reads its file through ``load_init`` (trainers and embedding servers alike), which also
takes the state dict of TorchRec's DLRM (core/interop.py).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from bagpipe.core import durable, interop
from bagpipe.core.model_config import ModelConfig


def save(path: str | os.PathLike[str], checkpoint: dict[str, Any]) -> None:
    """Writes atomically and durably (a fsynced temporary file renamed into place, its directory fsynced), so
    a reader never sees half a checkpoint and a power loss leaves the old file or the new one."""
    durable.write_atomically(Path(path), lambda tmp: torch.save(checkpoint, tmp))


def load_plain(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Loads a ``torch.save`` dictionary of tensors (no pickled code: ``weights_only``)."""
    ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    if not isinstance(ckpt, dict):
        raise ValueError(f"{path}: not a checkpoint dictionary (top level is {type(ckpt).__name__})")
    return ckpt


def load(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Loads and checks the top-level layout; names the missing part on error."""
    return _interchange(path, load_plain(path))


def _interchange(path: str | os.PathLike[str], ckpt: dict[str, Any]) -> dict[str, Any]:
    for key in ("dense", "embeddings"):
        if not isinstance(ckpt.get(key), dict):
            raise ValueError(f"{path}: interchange checkpoint has no '{key}' dictionary")
    return ckpt


def load_init(
    path: str | os.PathLike[str],
    model: str,
    embedding_dim: int,
    table_rows: Sequence[int],
    dense: ModelConfig | None = None,
) -> dict[str, Any]:
    """``--init-from``'s file as an interchange checkpoint, for a run of ``model`` with these tables: an
    interchange checkpoint as ``load`` reads it (its tensors are checked where they are loaded), or a
    TorchRec DLRM state dict (recognised by its keys) mapped to one by ``interop.from_torchrec``. That has
    no optimizer state, so the run's optimizer starts afresh, and its sizes are checked here against the
    run's (with ``dense``, the trainer's model, the dense sizes too): ValueError names each that differs."""
    ckpt = load_plain(path)
    if not interop.is_torchrec_dlrm(ckpt):
        return _interchange(path, ckpt)
    converted = interop.from_torchrec(ckpt)
    interop.check_fits(converted["meta"], model, embedding_dim, table_rows, dense)
    return converted


def max_abs_difference(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float]:
    """Largest absolute difference per tensor between two checkpoints (dense, embeddings, state)."""
    out: dict[str, float] = {}

    def walk(prefix: str, x: Any, y: Any) -> None:
        if isinstance(x, torch.Tensor):
            if not isinstance(y, torch.Tensor) or x.shape != y.shape:
                raise ValueError(f"{prefix}: shapes differ")
            out[prefix] = float((x.float() - y.float()).abs().max()) if x.numel() else 0.0
        elif isinstance(x, (int, float)) and not isinstance(x, bool):  # a step count
            if not isinstance(y, (int, float)):
                raise ValueError(f"{prefix}: {x!r} vs {y!r}")
            out[prefix] = abs(float(x) - float(y))
        elif isinstance(x, dict):
            if not isinstance(y, dict) or set(x) != set(y):
                raise ValueError(
                    f"{prefix}: keys differ: {sorted(x)} vs {sorted(y) if isinstance(y, dict) else y}"
                )
            for k in x:
                walk(f"{prefix}/{k}" if prefix else str(k), x[k], y[k])

    for section in ("dense", "embeddings", "linear"):
        if section in a or section in b:
            walk(section, a.get(section), b.get(section))
    if "optimizer" in a and "optimizer" in b:
        for section in ("dense", "embeddings", "linear"):
            walk(f"optimizer/{section}", a["optimizer"].get(section, {}), b["optimizer"].get(section, {}))
    return out


def table_rows(ckpt: dict[str, Any], table: int, dim: int, linear: bool) -> torch.Tensor:
    """Rows of ``table`` as stored: [rows, dim] embeddings, then the first-order column if ``linear``.
    Raises ValueError naming the entry whose shape does not fit."""
    emb = ckpt["embeddings"].get(str(table))
    if not isinstance(emb, torch.Tensor) or emb.dim() != 2 or emb.shape[1] != dim:
        got = tuple(emb.shape) if isinstance(emb, torch.Tensor) else None
        raise ValueError(f"embeddings/{table}: expected a [rows, {dim}] tensor, got {got}")
    if not linear:
        return emb.float()
    first = (ckpt.get("linear") or {}).get(str(table))
    if not isinstance(first, torch.Tensor) or tuple(first.shape) != (emb.shape[0], 1):
        got = tuple(first.shape) if isinstance(first, torch.Tensor) else None
        raise ValueError(
            f"linear/{table}: expected a [{emb.shape[0]}, 1] tensor (the model has first-order "
            f"weights), got {got}"
        )
    return torch.cat([emb.float(), first.float()], dim=1)


def table_state(
    ckpt: dict[str, Any], table: int, keys: tuple[str, ...], linear: bool
) -> tuple[torch.Tensor, int] | None:
    """The optimizer state of ``table``'s rows as stored (one block per key of ``keys``, each the row's
    width) and its step count; None when the checkpoint holds no such state (another optimizer's, or
    none: the optimizer then starts afresh, as torch's would)."""
    optimizer = ckpt.get("optimizer") or {}
    parts = [(optimizer.get("embeddings") or {}).get(str(table))]
    if linear:
        parts.append((optimizer.get("linear") or {}).get(str(table)))
    if not keys or any(not isinstance(p, dict) or not all(k in p for k in keys) for p in parts):
        return None
    # (no copy where one block is the whole state: a shard loading a checkpoint holds one table's at most)
    blocks = [_side_by_side([p[k].float().reshape(p[k].shape[0], -1) for p in parts]) for k in keys]  # type: ignore[index]
    return _side_by_side(blocks), int(parts[0].get("step", 0))  # type: ignore[union-attr]


def _side_by_side(tensors: list[torch.Tensor]) -> torch.Tensor:
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=1)


def put_table(
    out: dict[str, Any],
    table: int,
    rows: torch.Tensor,
    state: torch.Tensor,
    dim: int,
    keys: tuple[str, ...],
    linear: bool,
    step: int | None = None,
) -> None:
    """Splits stored rows (and state) of ``table`` into ``out``'s sections, the inverse of ``table_rows``
    and ``table_state``; ``step`` (Adam) goes with each table's state as SparseAdam keeps it."""
    t = str(table)
    width = dim + int(linear)
    out.setdefault("embeddings", {})[t] = rows[:, :dim].contiguous()
    if linear:
        out.setdefault("linear", {})[t] = rows[:, dim:].contiguous()
    if not keys:
        return
    optimizer = out.setdefault("optimizer", {})
    sections = [("embeddings", slice(0, dim))] + ([("linear", slice(dim, width))] if linear else [])
    for section, cols in sections:
        entry: dict[str, Any] = {} if step is None else {"step": step}
        for i, key in enumerate(keys):
            entry[key] = state[:, i * width : (i + 1) * width][:, cols].contiguous()
        optimizer.setdefault(section, {})[t] = entry
