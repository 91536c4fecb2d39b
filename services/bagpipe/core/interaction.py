"""DLRM's dot interaction on the CPU, compiled: the dots of every pair of a sample's features and their
gradients, one sample at a time.

(Over 400 lines: the forward and backward kernels of one operation, which share their tiling.)

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

A sample's rows come either as rows[s] of the batch's gathered rows [b, t, d], or by index from the
batch's unique rows [u, d] (``inverse`` [b, t]): then no gathered copy is made, and the backward adds
each sample's row gradients straight into the unique rows in the order the gather's backward adds them
(``_sum_rows`` in core/model.py), so both give the same bits. Shapes and positions are checked before
anything is read or written; the tiles themselves check nothing.

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
from numba.extending import intrinsic, overload

from bagpipe.core.intrinsics import fma

LANES = 8  # floats in a vector register (AVX); elsewhere LLVM splits the vectors into what the CPU has
_F32 = ir.FloatType()
_I32 = ir.IntType(32)
_I64 = ir.IntType(64)
_VEC = ir.VectorType(_F32, LANES)


def _arrays_ok(arrays: tuple[Any, ...], index: Any) -> bool:
    """The tiles' pointer arithmetic needs C-contiguous float32 arrays, and an index that is absent (None:
    the sample's rows are rows[s]) or C-contiguous int64 (the sample's rows are rows[index[s]])."""
    if any(not isinstance(t, types.Array) or t.layout != "C" or t.dtype != types.float32 for t in arrays):
        return False
    return isinstance(index, types.NoneType) or (
        isinstance(index, types.Array) and index.layout == "C" and index.dtype == types.int64
    )


def _vector_fma(builder: Any) -> Any:
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VEC, [_VEC] * 3), "llvm.fma.v8f32")


def _open(context: Any, builder: Any, signature: Any, args: Any, index_at: int) -> tuple[Any, ...]:
    """The intrinsic's array arguments as LLVM array structures (in order), and then its index argument's,
    or None where the index is None; other arguments are left out."""
    arrays = [
        context.make_array(kind)(context, builder, value)
        for i, (kind, value) in enumerate(zip(signature.args, args, strict=True))
        if isinstance(kind, types.Array) and i != index_at
    ]
    kind = signature.args[index_at]
    index = (
        None
        if isinstance(kind, types.NoneType)
        else context.make_array(kind)(context, builder, args[index_at])
    )
    return (*arrays, index)


def _vector_at(builder: Any, pointer: Any, offset: Any) -> Any:
    """A pointer to the 8 floats at ``pointer`` + ``offset`` (floats), as one vector."""
    return builder.bitcast(builder.gep(pointer, [offset]), _VEC.as_pointer())


def _load_vector(builder: Any, pointer: Any, offset: Any) -> Any:
    """The 8 floats at ``pointer`` + ``offset`` (floats), as a vector."""
    return builder.load(_vector_at(builder, pointer, offset), align=4)


def _register_sums(builder: Any, count: int) -> list[Any]:
    """``count`` vector sums starting at zero: a slot each, which LLVM keeps in a register (mem2reg), so the
    stores into them never reach memory."""
    zeros = ir.Constant(_VEC, [0.0] * LANES)
    return [cgutils.alloca_once_value(builder, zeros) for _ in range(count)]


def _lane_total(builder: Any, v: Any) -> Any:
    """The 8 lanes of ``v`` added as ``_lane_sum`` adds them: lanes l and l + 4, then those two apart."""
    undef, undef4 = ir.Constant(_VEC, None), ir.Constant(ir.VectorType(_F32, 4), None)
    half = builder.fadd(
        builder.shuffle_vector(v, undef, ir.Constant(ir.VectorType(_I32, 4), [0, 1, 2, 3])),
        builder.shuffle_vector(v, undef, ir.Constant(ir.VectorType(_I32, 4), [4, 5, 6, 7])),
    )
    quarter = builder.fadd(
        builder.shuffle_vector(half, undef4, ir.Constant(ir.VectorType(_I32, 2), [0, 1])),
        builder.shuffle_vector(half, undef4, ir.Constant(ir.VectorType(_I32, 2), [2, 3])),
    )
    return builder.fadd(builder.extract_element(quarter, _I32(0)), builder.extract_element(quarter, _I32(1)))


class _Features:
    """Addresses of sample s's features in LLVM code: feature 0 is ``first`` (bottom[s]), feature i the
    sample's row i - 1, either ``rows[s, i - 1]`` or, with an index, ``rows[index[s, i - 1]]``."""

    def __init__(self, builder: Any, first: Any, rows: Any, index: Any, s: Any, tables: Any) -> None:
        self.builder, self.first, self.rows, self.index = builder, first, rows, index
        self.first_row = builder.mul(s, tables)  # (the sample's first position in rows or in the index)
        self.dim = builder.extract_value(first.shape, 0)

    def row(self, t: Any) -> Any:
        """The position in ``rows`` of the sample's row t."""
        at = self.builder.add(self.first_row, t)
        return at if self.index is None else self.builder.load(self.builder.gep(self.index.data, [at]))

    def at(self, feature: Any, column: Any) -> Any:
        """A pointer to column ``column`` of ``feature``."""
        b = self.builder
        to_first = b.gep(self.first.data, [column])
        # (feature 0 has no row: it takes row 0's position, which every sample has, and does not use it)
        t = b.sub(feature, _I64(1))
        is_first = b.icmp_unsigned("==", feature, _I64(0))
        row = self.row(b.select(is_first, _I64(0), t))
        to_rows = b.gep(self.rows.data, [b.add(b.mul(row, self.dim), column)])
        return b.select(is_first, to_first, to_rows)


def _make_product_tile(features: int, vectors: int) -> Any:
    """An intrinsic ``tile(g, first, rows, index, s, grad_first, grad_rows, a, c)``: for the sample's
    features a .. a + ``features`` - 1 and the columns c .. c + 8 ``vectors`` - 1, the sum over b of
    g[a', b] x_b (``_Features`` says where x_b is), accumulated in registers in the order of b and stored
    into ``grad_first`` (feature 0) and ``grad_rows[a' - 1]``. Every index must be in range: the
    caller's loops and checks make them so, and nothing here checks."""

    @intrinsic
    def tile(
        typingctx: Any,
        g: Any,
        first: Any,
        rows: Any,
        index: Any,
        s: Any,
        grad_first: Any,
        grad_rows: Any,
        a: Any,
        c: Any,
    ) -> Any:
        if not _arrays_ok((g, first, rows, grad_first, grad_rows), index):
            return None  # (a typing error)
        sig = types.void(g, first, rows, index, types.int64, grad_first, grad_rows, types.int64, types.int64)

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            ga, fa, ra, gfa, gra, ia = _open(context, builder, signature, args, index_at=3)
            s_, a_, c_ = args[4], args[7], args[8]
            tables = builder.extract_value(gra.shape, 0)
            at = _Features(builder, fa, ra, ia, s_, tables)
            # the sample's gradients: feature 0's in grad_first, feature i's in its own grad_rows[i - 1]
            grads = _Features(builder, gfa, gra, None, _I64(0), tables)
            vector_fma = _vector_fma(builder)
            width = builder.extract_value(ga.shape, 1)  # (g is square: one row per feature)
            undef = ir.Constant(_VEC, None)
            splat = ir.Constant(ir.VectorType(_I32, LANES), [0] * LANES)
            sums = _register_sums(builder, features * vectors)

            def add_feature(x: Any, b: Any) -> None:
                xs = [_load_vector(builder, x, _I64(LANES * v)) for v in range(vectors)]
                for r in range(features):
                    where = builder.add(builder.mul(builder.add(a_, _I64(r)), width), b)
                    weight = builder.insert_element(
                        undef, builder.load(builder.gep(ga.data, [where])), _I32(0)
                    )
                    weights = builder.shuffle_vector(weight, undef, splat)
                    for v in range(vectors):
                        slot = sums[r * vectors + v]
                        builder.store(builder.call(vector_fma, [weights, xs[v], builder.load(slot)]), slot)

            add_feature(builder.gep(fa.data, [c_]), _I64(0))
            with cgutils.for_range(builder, tables) as loop:
                t = loop.index
                x = builder.gep(ra.data, [builder.add(builder.mul(at.row(t), at.dim), c_)])
                add_feature(x, builder.add(t, _I64(1)))
            for r in range(features):
                out = grads.at(builder.add(a_, _I64(r)), c_)
                for v in range(vectors):
                    where = _vector_at(builder, out, _I64(LANES * v))
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
    """An intrinsic ``tile(first, rows, index, s, tables, out, a, b)``: the dots x_a' . x_b' of the
    sample's features a' = a .. a + ``size`` - 1 and b' = b .. b + ``size`` - 1 (``_Features`` says where
    they are) over the columns that fill vectors of 8, each summed in the 8 lanes in column order and the
    lanes then added as ``_lane_sum`` does, stored into ``out`` (the sample's) where a' > b' (the strictly
    lower triangle, ``tril_indices`` order). Every index must be in range: the caller's loops and checks
    make them so, and nothing here checks."""

    @intrinsic
    def tile(
        typingctx: Any, first: Any, rows: Any, index: Any, s: Any, tables: Any, out: Any, a: Any, b: Any
    ) -> Any:
        if not _arrays_ok((first, rows, out), index):
            return None  # (a typing error)
        sig = types.void(first, rows, index, types.int64, types.int64, out, types.int64, types.int64)

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            fa, ra, oa, ia = _open(context, builder, signature, args, index_at=2)
            s_, tables, a_, b_ = args[3], args[4], args[6], args[7]
            at = _Features(builder, fa, ra, ia, s_, tables)
            vector_fma = _vector_fma(builder)
            xa = [at.at(builder.add(a_, _I64(r)), _I64(0)) for r in range(size)]
            xb = [at.at(builder.add(b_, _I64(c)), _I64(0)) for c in range(size)]
            sums = _register_sums(builder, size * size)
            with cgutils.for_range(builder, builder.udiv(at.dim, _I64(LANES))) as loop:
                column = builder.mul(loop.index, _I64(LANES))
                va = [_load_vector(builder, x, column) for x in xa]
                vb = [_load_vector(builder, x, column) for x in xb]
                for r in range(size):
                    for c in range(size):
                        slot = sums[r * size + c]
                        builder.store(builder.call(vector_fma, [va[r], vb[c], builder.load(slot)]), slot)
            for r in range(size):
                row = builder.add(a_, _I64(r))
                row_start = builder.lshr(builder.mul(row, builder.sub(row, _I64(1))), _I64(1))
                for c in range(size):
                    col = builder.add(b_, _I64(c))
                    dot = _lane_total(builder, builder.load(sums[r * size + c]))
                    with builder.if_then(builder.icmp_unsigned(">", row, col), likely=True):
                        builder.store(dot, builder.gep(oa.data, [builder.add(row_start, col)]))
            return context.get_dummy_value()

        return sig, codegen

    return tile


# three features by three: 9 sums and 6 loads in 15 of the 16 AVX registers
_DOTS = 3
_dots_tile = _make_dots_tile(_DOTS)


# Where the code differs between rows gathered per sample ([b, t, d], no index) and the batch's unique
# rows read by index, numba picks the version by the index's type when it compiles (``overload``).
def _row(rows, inverse, s, t):  # type: ignore[no-untyped-def]
    """Sample s's row t: rows[s, t], or rows[inverse[s, t]] (the batch's unique rows)."""
    return rows[s, t] if inverse is None else rows[inverse[s, t]]


@overload(_row)
def _row_compiled(rows, inverse, s, t):  # type: ignore[no-untyped-def]
    if isinstance(inverse, types.NoneType):
        return lambda rows, inverse, s, t: rows[s, t]
    return lambda rows, inverse, s, t: rows[np.uint64(inverse[s, t])]  # (checked: no wrap-around code)


def _prepare(bottom, rows, inverse, dots, grad_bottom, grad_rows):  # type: ignore[no-untyped-def]
    """Checks the arrays' shapes against each other and an index's positions against the unique rows,
    raising before anything is read or written; then, with an index, zeroes the unique rows' gradient
    (``grad_rows``, where it is not None). Returns the number of tables. ``dots`` is the forward's output
    or the backward's incoming gradient, [samples, pairs]."""
    raise NotImplementedError  # (compiled code only)


@njit(cache=True, nogil=True)
def _check_outputs(bottom, rows, dots, grad_bottom, grad_rows, tables):  # type: ignore[no-untyped-def]
    if dots.shape[0] != bottom.shape[0] or dots.shape[1] != (tables + 1) * tables // 2:
        raise ValueError("pair_dots: the dots (or their gradient) must be [samples, pairs of features]")
    if grad_bottom is not None and grad_bottom.shape != bottom.shape:
        raise ValueError("pair_dots: the bottom output's gradient must have its shape")
    if grad_rows is not None and grad_rows.shape != rows.shape:
        raise ValueError("pair_dots: the rows' gradient must have the rows' shape")


@overload(_prepare)
def _prepare_compiled(bottom, rows, inverse, dots, grad_bottom, grad_rows):  # type: ignore[no-untyped-def]
    if isinstance(inverse, types.NoneType):

        def gathered(bottom, rows, inverse, dots, grad_bottom, grad_rows):  # type: ignore[no-untyped-def]
            samples, tables, dim = rows.shape
            if bottom.shape[0] != samples or bottom.shape[1] != dim:
                raise ValueError("pair_dots: bottom must be [samples, dim] for rows [samples, tables, dim]")
            _check_outputs(bottom, rows, dots, grad_bottom, grad_rows, tables)
            return tables

        return gathered

    def indexed(bottom, rows, inverse, dots, grad_bottom, grad_rows):  # type: ignore[no-untyped-def]
        samples, tables = inverse.shape
        if bottom.shape[0] != samples or bottom.shape[1] != rows.shape[1]:
            raise ValueError(
                "pair_dots: bottom must be [samples, dim] for an index [samples, tables] of rows [u, dim]"
            )
        _check_outputs(bottom, rows, dots, grad_bottom, grad_rows, tables)
        for n in range(inverse.size):
            r = inverse.flat[n]
            if r < 0 or r >= rows.shape[0]:
                raise IndexError("pair_dots: an index of the batch's rows is outside the rows")
        if grad_rows is not None:
            grad_rows[:] = 0
        return tables

    return indexed


def _sample_out(grad_rows, scratch, inverse, s):  # type: ignore[no-untyped-def]
    """Where the backward puts sample s's row gradients: grad_rows[s], or a scratch to add from."""
    raise NotImplementedError  # (compiled code only)


@overload(_sample_out)
def _sample_out_compiled(grad_rows, scratch, inverse, s):  # type: ignore[no-untyped-def]
    if isinstance(inverse, types.NoneType):
        return lambda grad_rows, scratch, inverse, s: grad_rows[s]
    return lambda grad_rows, scratch, inverse, s: scratch


def _add_sample(grad_rows, scratch, inverse, s):  # type: ignore[no-untyped-def]
    """With an index: adds sample s's row gradients (``scratch``) into the unique rows' gradient, in the
    order of its tables, as ``_sum_rows`` in core/model.py adds them (the same bits)."""
    raise NotImplementedError  # (compiled code only)


@overload(_add_sample)
def _add_sample_compiled(grad_rows, scratch, inverse, s):  # type: ignore[no-untyped-def]
    if isinstance(inverse, types.NoneType):
        return lambda grad_rows, scratch, inverse, s: None

    def indexed(grad_rows, scratch, inverse, s):  # type: ignore[no-untyped-def]
        for t in range(scratch.shape[0]):
            into = grad_rows[np.uint64(inverse[s, t])]  # (checked: unsigned, no wrap-around code)
            for k in range(scratch.shape[1]):
                into[k] += scratch[t, k]

    return indexed


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
def pair_dots_forward(bottom, rows, inverse, out):  # type: ignore[no-untyped-def]
    """out[s] = the dots of sample s's features [bottom[s], its rows], ``tril_indices`` order. Its rows are
    rows[s] ([b, t, d]) where ``inverse`` is None, else rows[inverse[s]] (the batch's unique rows [u, d]
    and [b, t] positions in them, checked). Every array is C-contiguous, float32 but the int64 index."""
    samples, dim = bottom.shape
    tables = _prepare(bottom, rows, inverse, out, None, None)
    features = tables + 1
    vectors = dim // LANES
    blocks = (features + _DOTS - 1) // _DOTS
    for s in range(samples):
        first, dots = bottom[s], out[s]
        if features >= _DOTS:
            # the last block starts at features - 3 and may overlap the one before: a pair computed twice
            # is the same bits both times
            for i in range(blocks):
                a = min(i * _DOTS, features - _DOTS)
                for j in range(i + 1):
                    _dots_tile(first, rows, inverse, s, tables, dots, a, min(j * _DOTS, features - _DOTS))
        else:
            for i in range(1, features):
                for j in range(i):
                    x = first if j == 0 else _row(rows, inverse, s, j - 1)
                    dots[i * (i - 1) // 2 + j] = _lane_sum(_row(rows, inverse, s, i - 1), x, vectors)
        for k in range(vectors * LANES, dim):  # the columns short of a vector, in order, after the lanes
            p = 0
            for i in range(tables):
                xi = _row(rows, inverse, s, i)[k]
                dots[p] = fma(xi, first[k], dots[p])
                p += 1
                for j in range(i):
                    dots[p] = fma(xi, _row(rows, inverse, s, j)[k], dots[p])
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
def pair_dots_backward(bottom, rows, inverse, grad, grad_bottom, grad_rows):  # type: ignore[no-untyped-def]
    """The gradients of ``pair_dots_forward``'s inputs from ``grad`` of its output. ``grad_bottom`` is
    written. Where ``inverse`` is None, ``grad_rows`` ([b, t, d]) is written; else it is the unique rows'
    ([u, d]): zeroed, then each sample's row gradients added into it in the order of the samples and,
    within a sample, of its tables, as the batch gather's backward adds them (``_sum_rows`` in
    core/model.py: the same bits). Every array is C-contiguous, float32 but the int64 index."""
    samples, dim = bottom.shape
    tables = _prepare(bottom, rows, inverse, grad, grad_bottom, grad_rows)
    features = tables + 1
    g = np.zeros((features, features), dtype=np.float32)
    scratch = np.empty((tables, dim), dtype=np.float32)
    paired = features // 2 * 2
    wide = dim // (4 * LANES) * (4 * LANES)
    full = dim // LANES * LANES  # (the columns that fill vectors)
    for s in range(samples):
        _mirror(grad, s, g)
        first, grad_first = bottom[s], grad_bottom[s]
        out = _sample_out(grad_rows, scratch, inverse, s)
        for c in range(0, wide, 4 * LANES):
            for a in range(0, paired, 2):
                _tile_2x4(g, first, rows, inverse, s, grad_first, out, a, c)
            if paired < features:
                _tile_1x4(g, first, rows, inverse, s, grad_first, out, paired, c)
        for c in range(wide, full, LANES):
            for a in range(0, paired, 2):
                _tile_2x1(g, first, rows, inverse, s, grad_first, out, a, c)
            if paired < features:
                _tile_1x1(g, first, rows, inverse, s, grad_first, out, paired, c)
        for k in range(full, dim):  # the columns short of a vector: the same chains, one at a time
            for a in range(features):
                acc = np.float32(0)
                acc = fma(g[a, 0], first[k], acc)
                for t in range(tables):
                    acc = fma(g[a, t + 1], _row(rows, inverse, s, t)[k], acc)
                if a == 0:
                    grad_first[k] = acc
                else:
                    out[a - 1, k] = acc
        _add_sample(grad_rows, scratch, inverse, s)
