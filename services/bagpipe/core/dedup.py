"""A batch's keys deduplicated table by table, for ``core.data.build_batch`` (compiled with numba)."""

from __future__ import annotations

import threading

import numpy as np
from numba import njit

# a table of at most this many rows is deduplicated by marking its rows (4 B each of per-thread scratch),
# a larger one by sorting its column
MARK_ROWS = 1 << 22
_scratch = threading.local()


def _mark_scratch(rows: int) -> np.ndarray:
    """This thread's zeroed int32 scratch of at least ``rows`` entries (``_dedup_columns`` leaves it zero):
    a data processor builds the batches of concurrent streams on several threads."""
    mark = getattr(_scratch, "mark", None)
    if mark is None or mark.size < rows:
        mark = _scratch.mark = np.zeros(rows, dtype=np.int32)
    return mark


@njit(cache=True, nogil=True)
def _dedup_columns(sparse, offsets, mark, mark_rows):  # type: ignore[no-untyped-def]
    """Per table ``t``: the sorted distinct rows of ``sparse[:, t]`` plus ``offsets[t]``, concatenated, and
    each sample's index into them. Tables of at most ``mark_rows`` rows mark their rows in ``mark`` (as
    many entries at least; zero on entry and on return) and sort only the distinct ones; larger tables
    sort their column."""
    b, tables = sparse.shape
    inverse = np.empty((b, tables), dtype=np.int32)
    keys = np.empty(b * tables, dtype=np.int64)
    distinct = np.empty(b, dtype=np.int64)
    n = 0
    for t in range(tables):
        if offsets[t + 1] - offsets[t] <= mark_rows:
            u = 0
            for i in range(b):
                r = sparse[i, t]
                if mark[r] == 0:
                    mark[r] = 1
                    distinct[u] = r
                    u += 1
            ordered = np.sort(distinct[:u])
            for j in range(u):
                mark[ordered[j]] = n + j + 1  # (1-based: 0 is unmarked)
                keys[n + j] = ordered[j] + offsets[t]
            for i in range(b):
                inverse[i, t] = mark[sparse[i, t]] - 1
            for j in range(u):
                mark[ordered[j]] = 0
            n += u
        else:
            column = sparse[:, t].copy()
            order = np.argsort(column)
            previous = -1
            for k in range(b):
                i = order[k]
                if column[i] != previous:
                    previous = column[i]
                    keys[n] = previous + offsets[t]
                    n += 1
                inverse[i, t] = n - 1
    return keys[:n].copy(), inverse


def table_columns(sparse: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The sorted unique global keys of ``sparse`` (int64 ``[B, tables]``, each row in its table) and the
    int32 inverse index into them, as ``_dedup_columns`` computes them."""
    rows = np.diff(offsets)
    marked = rows[rows <= MARK_ROWS]
    return _dedup_columns(  # type: ignore[no-any-return]
        sparse,
        offsets.astype(np.int64, copy=False),
        _mark_scratch(int(marked.max()) if marked.size else 0),
        MARK_ROWS,
    )
