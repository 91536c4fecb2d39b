"""``bagpipe check-model PATH``: is this the finished run's model? (the chart's ``helm test``)

Loads the interchange checkpoint as plain PyTorch would and checks it against what the run was asked
for: the model, the tables' count and sizes, the embedding width, the number of optimizer steps (batches
trained), and that every tensor is finite. Exits 0 and prints a one-line summary, or 1 naming the first
thing that is wrong.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import torch

from bagpipe.core import checkpoint


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bagpipe check-model", description=__doc__.splitlines()[0])
    p.add_argument("path", help="the final interchange checkpoint (--save-final)")
    p.add_argument("--model", default=None, help="expected model name (dlrm, wdl, deepfm, dcn)")
    p.add_argument("--iterations", type=int, default=None, help="expected batches trained")
    p.add_argument("--tables", type=int, default=None, help="expected number of embedding tables")
    p.add_argument("--embedding-dim", type=int, default=None, help="expected embedding width")
    return p


def _tensors(section: Any, prefix: str) -> list[tuple[str, torch.Tensor]]:
    if isinstance(section, torch.Tensor):
        return [(prefix, section)]
    if isinstance(section, dict):
        return [t for k, v in section.items() for t in _tensors(v, f"{prefix}/{k}")]
    return []


def check(args: argparse.Namespace) -> dict[str, Any]:
    """The summary of a good model; raises ValueError naming what is wrong."""
    path = Path(args.path)
    if not path.exists():
        raise ValueError(
            f"{path}: no such file (has the run finished? `kubectl wait --for=condition=complete`)"
        )
    ckpt = checkpoint.load(path)
    meta = ckpt.get("meta", {})
    tables = ckpt["embeddings"]
    if args.model is not None and meta.get("model") != args.model:
        raise ValueError(f"{path}: meta.model is {meta.get('model')!r}, expected {args.model!r}")
    if args.tables is not None and len(tables) != args.tables:
        raise ValueError(f"{path}: {len(tables)} embedding tables, expected {args.tables}")
    rows = meta.get("table_rows")
    for i, (name, weight) in enumerate(tables.items()):
        if weight.ndim != 2:
            raise ValueError(
                f"{path}: embeddings/{name} has shape {list(weight.shape)}, expected [rows, dim]"
            )
        if args.embedding_dim is not None and weight.shape[1] != args.embedding_dim:
            raise ValueError(
                f"{path}: embeddings/{name} is {weight.shape[1]} wide, expected {args.embedding_dim}"
            )
        if rows is not None and i < len(rows) and weight.shape[0] != rows[i]:
            raise ValueError(f"{path}: embeddings/{name} has {weight.shape[0]} rows, meta says {rows[i]}")
    steps = meta.get("optimizer_steps")
    if args.iterations is not None and steps != args.iterations:
        raise ValueError(
            f"{path}: trained {steps} batches (meta.optimizer_steps), expected {args.iterations}"
        )
    count = 0
    for name, tensor in _tensors({k: ckpt[k] for k in ("dense", "embeddings", "linear") if k in ckpt}, ""):
        count += tensor.numel()
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"{path}: {name.lstrip('/')} has non-finite values")
    return {
        "path": str(path),
        "model": meta.get("model"),
        "tables": len(tables),
        "embedding_dim": meta.get("embedding_dim"),
        "batches": steps,
        "parameters": count,
        "size_mib": round(path.stat().st_size / 2**20, 1),
        "finite": True,
        "dense_norm": math.sqrt(sum(float((t.double() ** 2).sum()) for _, t in _tensors(ckpt["dense"], ""))),
    }


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        summary = check(args)
    except ValueError as e:
        print(f"bagpipe check-model: {e}", file=sys.stderr)
        return 1
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
