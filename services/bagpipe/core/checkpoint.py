"""The interchange checkpoint: one ``torch.save`` file plain PyTorch can load.

``{"dense": {name: tensor}, "embeddings": {"<table>": FloatTensor[rows, dim]},
"optimizer": {"name", "lr", "dense": {name: {"sum": tensor}}, "embeddings": {"<table>": {"sum": ...}}},
"meta": {...}}``. Adagrad state is under ``"sum"`` as in ``torch.optim.Adagrad``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch


def save(path: str | os.PathLike[str], checkpoint: dict[str, Any]) -> None:
    """Writes atomically (temporary file, then rename) so a reader never sees half a checkpoint."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    torch.save(checkpoint, tmp)
    os.replace(tmp, target)


def load_plain(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Loads a ``torch.save`` dictionary of tensors (no pickled code: ``weights_only``)."""
    ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    if not isinstance(ckpt, dict):
        raise ValueError(f"{path}: not a checkpoint dictionary (top level is {type(ckpt).__name__})")
    return ckpt


def load(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Loads and checks the top-level layout; names the missing part on error."""
    ckpt = load_plain(path)
    for key in ("dense", "embeddings"):
        if not isinstance(ckpt.get(key), dict):
            raise ValueError(f"{path}: interchange checkpoint has no '{key}' dictionary")
    return ckpt


def max_abs_difference(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float]:
    """Largest absolute difference per tensor between two checkpoints (dense, embeddings, state)."""
    out: dict[str, float] = {}

    def walk(prefix: str, x: Any, y: Any) -> None:
        if isinstance(x, torch.Tensor):
            if not isinstance(y, torch.Tensor) or x.shape != y.shape:
                raise ValueError(f"{prefix}: shapes differ")
            out[prefix] = float((x.float() - y.float()).abs().max()) if x.numel() else 0.0
        elif isinstance(x, dict):
            if not isinstance(y, dict) or set(x) != set(y):
                raise ValueError(f"{prefix}: keys differ: {sorted(x)} vs {sorted(y) if isinstance(y, dict) else y}")
            for k in x:
                walk(f"{prefix}/{k}" if prefix else str(k), x[k], y[k])

    for section in ("dense", "embeddings"):
        walk(section, a[section], b[section])
    if "optimizer" in a and "optimizer" in b:
        for section in ("dense", "embeddings"):
            walk(f"optimizer/{section}", a["optimizer"].get(section, {}), b["optimizer"].get(section, {}))
    return out
