"""Two LLVM intrinsics for the compiled (numba) loops, which numba does not expose.

* ``load_early(array, index)`` asks the CPU to start loading ``array[index]`` into its caches: a loop that
  reads records at random (the planner's per-key state) names the record it will read a few dozen
  iterations later, so that many cache misses are under way at once instead of the few the CPU finds
  on its own. It changes no value.
* ``fma(a, b, c)`` is ``a * b + c`` in float32 with one rounding, the way torch's CPU kernels add a
  scaled tensor (``add_(x, alpha=...)``, ``addcmul_``), so a compiled loop can give the same bits.

``gather_rows`` uses ``load_early`` on an embedding server: a lookup's rows, read at random from a table
of gigabytes, each loaded a few rows ahead of its copy.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

_I32 = ir.IntType(32)
_BYTE_POINTER = ir.IntType(8).as_pointer()


@intrinsic
def load_early(typingctx: Any, array: Any, index: Any) -> Any:
    """Starts loading ``array[index]`` (a 1-D array, an in-bounds index) for reading."""
    sig = types.void(array, index)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        kind = signature.args[0]
        view = context.make_array(kind)(context, builder, args[0])
        where = cgutils.get_item_pointer(context, builder, kind, view, [args[1]], wraparound=False)
        fn = cgutils.get_or_insert_function(
            builder.module,
            ir.FunctionType(ir.VoidType(), [_BYTE_POINTER, _I32, _I32, _I32]),
            "llvm.prefetch.p0",
        )
        # read (0), keep in every cache level (3), data rather than instructions (1)
        builder.call(fn, [builder.bitcast(where, _BYTE_POINTER), _I32(0), _I32(3), _I32(1)])
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def fma(typingctx: Any, a: Any, b: Any, c: Any) -> Any:
    """``a * b + c`` rounded once (float32)."""
    sig = types.float32(types.float32, types.float32, types.float32)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.fma(*args)

    return sig, codegen


# how many rows ahead ``gather_rows`` starts a row's load: 4 to 128 did equally well (bench/README.md)
ROWS_AHEAD = 16


@njit(cache=True, nogil=True)
def gather_rows(table, index, out):  # type: ignore[no-untyped-def]
    """``out[i] = table[index[i]]`` for every ``i``, each index already checked to be in range (this loop
    does not check). numpy's ``take`` copies one row at a time and waits for each row's cache misses in
    turn; loading ``ROWS_AHEAD`` rows ahead keeps that many misses under way."""
    n = index.size
    width = table.shape[1]
    for i in range(n):
        if i + ROWS_AHEAD < n and width:
            ahead = table[np.uint64(index[i + ROWS_AHEAD])]
            load_early(ahead, 0)
            load_early(ahead, width - 1)  # (a row of 128 bytes spans two cache lines)
        r = np.uint64(index[i])  # (unsigned: no wrap-around of a negative index, 24-28% faster here)
        for j in range(width):
            out[i, j] = table[r, j]
