"""DLRM's dot interaction on the CPU, compiled: the dots of every pair of a sample's features and their
gradients, one sample at a time.

A sample's features are x_0 = the bottom MLP's output and x_1.. x_t = its rows. The forward gives the
dots of the strictly lower triangle in ``torch.tril_indices`` order. The backward is one product per
sample, dx_a = sum over b of G[a, b] x_b, with G the symmetric matrix of the dots' gradients (zero
diagonal): the gradient of x_a . x_b is x_b for x_a and x_a for x_b.

Both keep their sums in vector registers for as long as they add into them. The compiler would otherwise
load and store a sum at every step (the loops adding each pair into two rows' gradients did), and numba
leaves LLVM's SLP vectoriser off, so the tiles are written as LLVM vector code (``_make_product_tile``,
``_make_dots_tile``). Every value has one order of rounding, whichever code computes it:
- the backward: each element is one chain of fused multiply-adds over b = 0, 1, ..., t;
- the forward: each dot is summed in 8 lanes (column k into lane k mod 8, fused multiply-adds), the
  lanes are added as ``_lane_sum`` does, and the columns that do not fill a vector of 8 follow in order.
Each sample's loops are the same whatever batch surrounds it, so a trainer's slice and the reference's
whole batch give the same bits (unit tests check both).

At the quick profile's shapes (1,024 samples of 27 features of 64 floats), one core: the backward took
5.9-7.4 ms as the loop adding each pair into both rows' gradients and 2.4-3.0 ms now; the forward
1.9-2.1 ms as a loop per pair and 1.2-1.3 ms now (bench/README.md, "Trainer profile").
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from bagpipe.core.intrinsics import fma

LANES = 8  # floats in a vector register (AVX); elsewhere LLVM splits the vectors into what the CPU has
_F32 = ir.FloatType()
_I32 = ir.IntType(32)
_I64 = ir.IntType(64)
_VEC = ir.VectorType(_F32, LANES)


def _make_product_tile(features: int, vectors: int) -> Any:
    """An intrinsic ``tile(g, bottom, rows, grad_bottom, grad_rows, s, a, c)``: for the sample's features
    a .. a + ``features`` - 1 and the columns c .. c + 8 ``vectors`` - 1, the sum over b of g[a', b] x_b,
    accumulated in registers in the order of b and stored into the gradients (feature 0's into
    ``grad_bottom[s]``, feature i's into ``grad_rows[s, i - 1]``). Every index must be in range: the
    caller's loops make them so, and nothing here checks."""

    @intrinsic
    def tile(
        typingctx: Any,
        g: Any,
        bottom: Any,
        rows: Any,
        grad_bottom: Any,
        grad_rows: Any,
        s: Any,
        a: Any,
        c: Any,
    ) -> Any:
        arrays = (g, bottom, rows, grad_bottom, grad_rows)
        if any(not isinstance(t, types.Array) or t.layout != "C" or t.dtype != types.float32 for t in arrays):
            return None  # (a typing error: the pointer arithmetic below needs C-contiguous float32)
        sig = types.void(*arrays, types.int64, types.int64, types.int64)

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            ga, ba, ra, gba, gra = (
                context.make_array(kind)(context, builder, value)
                for kind, value in zip(signature.args[:5], args[:5], strict=True)
            )
            s_, a_, c_ = args[5:]
            vector_pointer = _VEC.as_pointer()
            vector_fma = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(_VEC, [_VEC] * 3), "llvm.fma.v8f32"
            )
            width = builder.extract_value(ga.shape, 1)  # (g is square: one row per feature)
            tables = builder.extract_value(ra.shape, 1)
            dim = builder.extract_value(ra.shape, 2)
            undef = ir.Constant(_VEC, None)
            splat = ir.Constant(ir.VectorType(_I32, LANES), [0] * LANES)
            # a slot per sum: LLVM keeps each in a register (mem2reg); the loop's stores never reach memory
            zeros = ir.Constant(_VEC, [0.0] * LANES)
            sums = [cgutils.alloca_once_value(builder, zeros) for _ in range(features * vectors)]

            def add_feature(x: Any, b: Any) -> None:
                xs = [
                    builder.load(builder.bitcast(builder.gep(x, [_I64(LANES * v)]), vector_pointer), align=4)
                    for v in range(vectors)
                ]
                for r in range(features):
                    at = builder.add(builder.mul(builder.add(a_, _I64(r)), width), b)
                    weight = builder.insert_element(undef, builder.load(builder.gep(ga.data, [at])), _I32(0))
                    weights = builder.shuffle_vector(weight, undef, splat)
                    for v in range(vectors):
                        slot = sums[r * vectors + v]
                        builder.store(builder.call(vector_fma, [weights, xs[v], builder.load(slot)]), slot)

            add_feature(builder.gep(ba.data, [builder.add(builder.mul(s_, dim), c_)]), _I64(0))
            first_row = builder.mul(s_, tables)
            with cgutils.for_range(builder, tables) as loop:
                t = loop.index
                x = builder.gep(ra.data, [builder.add(builder.mul(builder.add(first_row, t), dim), c_)])
                add_feature(x, builder.add(t, _I64(1)))
            for r in range(features):
                feature = builder.add(a_, _I64(r))
                to_bottom = builder.gep(gba.data, [builder.add(builder.mul(s_, dim), c_)])
                # (for feature 0 this address is a row before the sample's: chosen against, never stored to)
                row = builder.add(first_row, builder.sub(feature, _I64(1)))
                to_rows = builder.gep(gra.data, [builder.add(builder.mul(row, dim), c_)])
                out = builder.select(builder.icmp_unsigned("==", feature, _I64(0)), to_bottom, to_rows)
                for v in range(vectors):
                    where = builder.bitcast(builder.gep(out, [_I64(LANES * v)]), vector_pointer)
                    builder.store(builder.load(sums[r * vectors + v]), where, align=4)
            return context.get_dummy_value()

        return sig, codegen

    return tile


# two features by 32 columns: 8 sums, 4 loads and 2 broadcasts in 14 of the 16 AVX registers
_tile_2x4 = _make_product_tile(2, 4)
_tile_1x4 = _make_product_tile(1, 4)
_tile_2x1 = _make_product_tile(2, 1)
_tile_1x1 = _make_product_tile(1, 1)


def _make_dots_tile(size: int) -> Any:
    """An intrinsic ``tile(bottom, rows, out, s, a, b)``: the dots x_a' . x_b' of the sample's features
    a' = a .. a + ``size`` - 1 and b' = b .. b + ``size`` - 1 over the columns that fill vectors of 8, each
    summed in the 8 lanes in column order and the lanes then added as ``_lane_sum`` does, stored into
    out[s] where a' > b' (the strictly lower triangle, ``tril_indices`` order). Every index must be in
    range: the caller's loops make them so, and nothing here checks."""

    @intrinsic
    def tile(typingctx: Any, bottom: Any, rows: Any, out: Any, s: Any, a: Any, b: Any) -> Any:
        arrays = (bottom, rows, out)
        if any(not isinstance(t, types.Array) or t.layout != "C" or t.dtype != types.float32 for t in arrays):
            return None  # (a typing error: the pointer arithmetic below needs C-contiguous float32)
        sig = types.void(*arrays, types.int64, types.int64, types.int64)

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            ba, ra, oa = (
                context.make_array(kind)(context, builder, value)
                for kind, value in zip(signature.args[:3], args[:3], strict=True)
            )
            s_, a_, b_ = args[3:]
            vector_pointer = _VEC.as_pointer()
            vector_fma = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(_VEC, [_VEC] * 3), "llvm.fma.v8f32"
            )
            tables = builder.extract_value(ra.shape, 1)
            dim = builder.extract_value(ra.shape, 2)
            pairs = builder.extract_value(oa.shape, 1)
            first_row = builder.mul(s_, tables)

            def feature_at(feature: Any) -> Any:
                to_bottom = builder.gep(ba.data, [builder.mul(s_, dim)])
                # (for feature 0 this address is a row before the sample's: chosen against, never read)
                row = builder.add(first_row, builder.sub(feature, _I64(1)))
                to_rows = builder.gep(ra.data, [builder.mul(row, dim)])
                return builder.select(builder.icmp_unsigned("==", feature, _I64(0)), to_bottom, to_rows)

            xa = [feature_at(builder.add(a_, _I64(r))) for r in range(size)]
            xb = [feature_at(builder.add(b_, _I64(c))) for c in range(size)]
            zeros = ir.Constant(_VEC, [0.0] * LANES)
            sums = [cgutils.alloca_once_value(builder, zeros) for _ in range(size * size)]
            with cgutils.for_range(builder, builder.udiv(dim, _I64(LANES))) as loop:
                at = builder.mul(loop.index, _I64(LANES))

                def load(x: Any) -> Any:
                    return builder.load(builder.bitcast(builder.gep(x, [at]), vector_pointer), align=4)

                va, vb = [load(x) for x in xa], [load(x) for x in xb]
                for r in range(size):
                    for c in range(size):
                        slot = sums[r * size + c]
                        builder.store(builder.call(vector_fma, [va[r], vb[c], builder.load(slot)]), slot)
            undef, undef4 = ir.Constant(_VEC, None), ir.Constant(ir.VectorType(_F32, 4), None)
            for r in range(size):
                row = builder.add(a_, _I64(r))
                row_start = builder.add(
                    builder.mul(s_, pairs), builder.lshr(builder.mul(row, builder.sub(row, _I64(1))), _I64(1))
                )
                for c in range(size):
                    col = builder.add(b_, _I64(c))
                    v = builder.load(sums[r * size + c])
                    half = builder.fadd(
                        builder.shuffle_vector(v, undef, ir.Constant(ir.VectorType(_I32, 4), [0, 1, 2, 3])),
                        builder.shuffle_vector(v, undef, ir.Constant(ir.VectorType(_I32, 4), [4, 5, 6, 7])),
                    )
                    quarter = builder.fadd(
                        builder.shuffle_vector(half, undef4, ir.Constant(ir.VectorType(_I32, 2), [0, 1])),
                        builder.shuffle_vector(half, undef4, ir.Constant(ir.VectorType(_I32, 2), [2, 3])),
                    )
                    dot = builder.fadd(
                        builder.extract_element(quarter, _I32(0)), builder.extract_element(quarter, _I32(1))
                    )
                    with builder.if_then(builder.icmp_unsigned(">", row, col), likely=True):
                        builder.store(dot, builder.gep(oa.data, [builder.add(row_start, col)]))
            return context.get_dummy_value()

        return sig, codegen

    return tile


# three features by three: 9 sums and 6 loads in 15 of the 16 AVX registers
_DOTS = 3
_dots_tile = _make_dots_tile(_DOTS)


@njit(cache=True, nogil=True)
def _lane_sum(x, y, vectors):  # type: ignore[no-untyped-def]
    """x . y over the first ``vectors`` x 8 columns in the tile's order: lane l sums columns l, l + 8, ...
    by fused multiply-adds, then lanes l and l + 4, those sums two apart, and the last two are added."""
    lanes = np.zeros(LANES, dtype=np.float32)
    for m in range(vectors):
        for lane in range(LANES):
            lanes[lane] = fma(x[m * LANES + lane], y[m * LANES + lane], lanes[lane])
    half = lanes[:4] + lanes[4:]
    quarter = half[:2] + half[2:]
    return quarter[0] + quarter[1]


@njit(cache=True, nogil=True)
def pair_dots_forward(bottom, rows, out):  # type: ignore[no-untyped-def]
    """out[s] = the dots of sample s's features [bottom[s], rows[s, 0], ...], ``tril_indices`` order.
    Every array is C-contiguous float32."""
    samples, tables, dim = rows.shape
    features = tables + 1
    vectors = dim // LANES
    blocks = (features + _DOTS - 1) // _DOTS
    for s in range(samples):
        if features >= _DOTS:
            # the last block starts at features - 3 and may overlap the one before: a pair computed twice
            # is the same bits both times
            for i in range(blocks):
                a = min(i * _DOTS, features - _DOTS)
                for j in range(i + 1):
                    _dots_tile(bottom, rows, out, s, a, min(j * _DOTS, features - _DOTS))
        else:
            for i in range(1, features):
                for j in range(i):
                    x = bottom[s] if j == 0 else rows[s, j - 1]
                    out[s, i * (i - 1) // 2 + j] = _lane_sum(rows[s, i - 1], x, vectors)
        for k in range(vectors * LANES, dim):  # the columns short of a vector, in order, after the lanes
            p = 0
            for i in range(tables):
                xi = rows[s, i]
                out[s, p] = fma(xi[k], bottom[s, k], out[s, p])
                p += 1
                for j in range(i):
                    out[s, p] = fma(xi[k], rows[s, j, k], out[s, p])
                    p += 1


@njit(cache=True, nogil=True)
def _mirror(grad, s, g):  # type: ignore[no-untyped-def]
    """g = the symmetric matrix of sample s's dot gradients (``tril_indices`` order), zero diagonal."""
    p = 0
    for a in range(1, g.shape[0]):
        for b in range(a):
            v = grad[s, p]
            g[a, b] = v
            g[b, a] = v
            p += 1


@njit(cache=True, nogil=True)
def pair_dots_backward(bottom, rows, grad, grad_bottom, grad_rows):  # type: ignore[no-untyped-def]
    """The gradients of ``pair_dots_forward``'s inputs from ``grad`` of its output (written, not added).
    Every array is C-contiguous float32."""
    samples, tables, dim = rows.shape
    features = tables + 1
    g = np.zeros((features, features), dtype=np.float32)
    paired = features // 2 * 2
    wide = dim // (4 * LANES) * (4 * LANES)
    vectors = dim // LANES * LANES
    for s in range(samples):
        _mirror(grad, s, g)
        for c in range(0, wide, 4 * LANES):
            for a in range(0, paired, 2):
                _tile_2x4(g, bottom, rows, grad_bottom, grad_rows, s, a, c)
            if paired < features:
                _tile_1x4(g, bottom, rows, grad_bottom, grad_rows, s, paired, c)
        for c in range(wide, vectors, LANES):
            for a in range(0, paired, 2):
                _tile_2x1(g, bottom, rows, grad_bottom, grad_rows, s, a, c)
            if paired < features:
                _tile_1x1(g, bottom, rows, grad_bottom, grad_rows, s, paired, c)
        for k in range(vectors, dim):  # the columns short of a vector: the same chains, one at a time
            for a in range(features):
                acc = np.float32(0)
                acc = fma(g[a, 0], bottom[s, k], acc)
                for t in range(tables):
                    acc = fma(g[a, t + 1], rows[s, t, k], acc)
                if a == 0:
                    grad_bottom[s, k] = acc
                else:
                    grad_rows[s, a - 1, k] = acc
