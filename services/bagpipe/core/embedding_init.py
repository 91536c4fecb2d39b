"""Deterministic initial values of embedding rows, a pure function of (seed, global key, column).

Every row is uniform in ``[-1/sqrt(n), 1/sqrt(n)]`` for a table of ``n`` rows (the DLRM reference
initialisation), drawn from a counter-based hash rather than a sequential generator, so a row's
initial value does not depend on which server holds it or how many servers there are. A row still at its
initial value need not cross the network at all: whoever knows the seed, the tables and the width can
compute it (:func:`fingerprint` names that combination), which is how a lookup skips such rows.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
from numba import njit

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
    """float32 [len(keys), dim]: the initial value of every global key.

    A compiled loop (a few nanoseconds a value); it computes exactly what :func:`init_rows_numpy`
    does, operation for operation, in the same IEEE arithmetic."""
    keys, bound = _keys_and_bounds(keys, offsets)
    out = np.empty((keys.size, dim), dtype=np.float32)
    _fill(keys, bound, splitmix64(np.uint64(seed)), out)
    return out


def _keys_and_bounds(keys: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``keys`` as int64, and each one's bound ``1/sqrt(n)`` for its table of ``n`` rows (float64)."""
    keys = np.asarray(keys, dtype=np.int64)
    table = np.searchsorted(offsets, keys, side="right") - 1
    return keys, 1.0 / np.sqrt((offsets[table + 1] - offsets[table]).astype(np.float64))


@njit(cache=True, nogil=True)
def _splitmix(z):  # type: ignore[no-untyped-def]
    z = z + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


@njit(cache=True, nogil=True)
def _fill(keys, bound, salt, out):  # type: ignore[no-untyped-def]
    """``out[i, j]`` = the initial value of column ``j`` of ``keys[i]`` (``bound``: its table's)."""
    dim = out.shape[1]
    scale = 1.0 / 9007199254740992.0  # 2**-53
    for i in range(keys.size):
        base = _splitmix(np.uint64(keys[i]) * np.uint64(dim) + salt)
        b = bound[i]
        for j in range(dim):
            bits = _splitmix(base + np.uint64(j) * _GOLDEN)
            unit = np.float64(bits >> np.uint64(11)) * scale
            out[i, j] = np.float32((2.0 * unit - 1.0) * b)


class InitialRows:
    """Computes initial rows as the embedding servers of a job do (tables ``offsets``, width ``dim``,
    ``seed``): a lookup client with one is sent only the rows that have changed."""

    def __init__(self, offsets: np.ndarray, dim: int, seed: int) -> None:
        self.offsets = np.asarray(offsets, dtype=np.int64)
        self.dim = dim
        self.seed = seed
        self.fingerprint = fingerprint(self.offsets, dim, seed)
        self.rows(np.zeros(0, dtype=np.int64))  # compiled (or loaded from numba's cache) now, not mid-fetch

    def rows(self, keys: np.ndarray) -> np.ndarray:
        return init_rows(keys, self.offsets, self.dim, self.seed)


def fingerprint(offsets: np.ndarray, dim: int, seed: int) -> int:
    """What the initial rows depend on (tables, width, seed), as one positive int64: two parties that
    agree on it compute the same initial rows."""
    h = hashlib.blake2b(digest_size=8)
    h.update(np.asarray(offsets, dtype="<i8").tobytes())
    h.update(np.asarray([dim, seed], dtype="<i8").tobytes())
    return int.from_bytes(h.digest(), "little") >> 1 | 1


def init_rows_numpy(keys: np.ndarray, offsets: np.ndarray, dim: int, seed: int) -> np.ndarray:
    """:func:`init_rows` in numpy array arithmetic: the definition, kept as the reference the tests hold
    the compiled loop to."""
    keys, bound = _keys_and_bounds(keys, offsets)
    with np.errstate(over="ignore"):
        base = splitmix64(keys.astype(np.uint64) * np.uint64(dim) + splitmix64(np.uint64(seed)))
        cols = np.arange(dim, dtype=np.uint64)
        bits = splitmix64(base[:, None] + cols[None, :] * _GOLDEN)
    unit = (bits >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))  # [0, 1)
    return ((2.0 * unit - 1.0) * bound[:, None]).astype(np.float32)
