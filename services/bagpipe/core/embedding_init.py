"""Deterministic initial values of embedding rows, a pure function of (seed, global key, column).

Every row is uniform in ``[-1/sqrt(n), 1/sqrt(n)]`` for a table of ``n`` rows (the DLRM reference
initialisation), drawn from a counter-based hash rather than a sequential generator, so a row's
initial value does not depend on which server holds it or how many servers there are.
"""

from __future__ import annotations

from typing import Any

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def splitmix64(x: Any) -> Any:
    """The splitmix64 finaliser, elementwise on uint64 (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        z = x + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        return z ^ (z >> np.uint64(31))


def init_rows(keys: np.ndarray, offsets: np.ndarray, dim: int, seed: int) -> np.ndarray:
    """float32 [len(keys), dim]: the initial value of every global key."""
    keys = np.asarray(keys, dtype=np.int64)
    table = np.searchsorted(offsets, keys, side="right") - 1
    bound = 1.0 / np.sqrt((offsets[table + 1] - offsets[table]).astype(np.float64))
    with np.errstate(over="ignore"):
        base = splitmix64(keys.astype(np.uint64) * np.uint64(dim) + splitmix64(np.uint64(seed)))
        cols = np.arange(dim, dtype=np.uint64)
        bits = splitmix64(base[:, None] + cols[None, :] * _GOLDEN)
    unit = (bits >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))  # [0, 1)
    return ((2.0 * unit - 1.0) * bound[:, None]).astype(np.float32)
