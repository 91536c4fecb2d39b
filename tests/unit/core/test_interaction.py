"""The compiled dot interaction (core/interaction.py) against plain arithmetic, bit for bit: the backward's
every element is one chain of fused multiply-adds over the features in order, whether a register tile of
32 or 8 columns or the scalar loop for the columns short of a vector computes it; the forward's every dot
is summed in 8 lanes, then across them, then over the columns short of a vector, whether a tile of 3 x 3
pairs (overlapping or not) or the scalar loop computes it."""

from __future__ import annotations

import numpy as np
import pytest
from bagpipe.core.interaction import pair_dots_backward, pair_dots_forward
from bagpipe.core.model import _sum_rows


def _sample(tables: int, dim: int, samples: int = 5, seed: int = 3) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed + 100 * tables + dim)
    bottom = rng.standard_normal((samples, dim), dtype=np.float32)
    rows = rng.standard_normal((samples, tables, dim), dtype=np.float32)
    grad = rng.standard_normal((samples, (tables + 1) * tables // 2), dtype=np.float32)
    return bottom, rows, grad


def _mirrored(grad: np.ndarray, features: int) -> np.ndarray:
    g = np.zeros((grad.shape[0], features, features), dtype=np.float32)
    lower, upper = np.tril_indices(features, -1)
    g[:, lower, upper] = grad
    g[:, upper, lower] = grad
    return g


def _fused(chain: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """chain + x * y rounded once to float32, as a fused multiply-add (a product of float32s is exact in
    float64; a double rounding, which these values do not meet, aside)."""
    return (x.astype(np.float64) * y + chain).astype(np.float32)


# (26, 64): the quick profile's shapes, two tiles of 32 columns; 48: one tile of 32 and two of 8;
# 12 and 37: vectors and a scalar tail; 4 and 5: under one vector; 25 tables: an even feature count;
# 1 table: one pair, below the forward's tiles of three features
SHAPES = [(26, 64), (26, 48), (25, 16), (3, 12), (2, 37), (26, 4), (1, 5), (1, 37)]


@pytest.mark.parametrize(("tables", "dim"), SHAPES)
def test_the_backward_is_one_fused_chain_per_element_in_feature_order(tables: int, dim: int) -> None:
    bottom, rows, grad = _sample(tables, dim)
    grad_bottom, grad_rows = np.full_like(bottom, np.nan), np.full_like(rows, np.nan)
    pair_dots_backward(bottom, rows, None, grad, grad_bottom, grad_rows)
    features = np.concatenate([bottom[:, None], rows], axis=1).astype(np.float64)
    g = _mirrored(grad, tables + 1).astype(np.float64)
    chain = np.zeros((bottom.shape[0], tables + 1, dim), dtype=np.float32)
    for b in range(tables + 1):
        chain = _fused(chain, g[:, :, b, None], features[:, None, b, :])
    got = np.concatenate([grad_bottom[:, None], grad_rows], axis=1)
    np.testing.assert_array_equal(got, chain)
    np.testing.assert_allclose(got, np.einsum("sab,sbd->sad", g, features), rtol=1e-5, atol=1e-5)


# 3 tables: 4 features, the last block of three overlapping the first; 1 table: one pair, below a block
@pytest.mark.parametrize(("tables", "dim"), [*SHAPES, (3, 64)])
def test_the_forward_sums_each_pair_in_lanes_then_across_them_then_the_tail(tables: int, dim: int) -> None:
    bottom, rows, _ = _sample(tables, dim)
    out = np.full((bottom.shape[0], (tables + 1) * tables // 2), np.nan, dtype=np.float32)
    pair_dots_forward(bottom, rows, None, out)
    features = np.concatenate([bottom[:, None], rows], axis=1)
    lower, upper = np.tril_indices(tables + 1, -1)
    x, y = features[:, lower], features[:, upper]  # [samples, pairs, dim]
    vectors = dim // 8
    lanes = np.zeros(x.shape[:2] + (8,), dtype=np.float32)
    for m in range(vectors):
        lanes = _fused(lanes, x[..., m * 8 : m * 8 + 8], y[..., m * 8 : m * 8 + 8])
    half = lanes[..., :4] + lanes[..., 4:]
    quarter = half[..., :2] + half[..., 2:]
    want = quarter[..., 0] + quarter[..., 1]
    for k in range(vectors * 8, dim):
        want = _fused(want, x[..., k], y[..., k])
    np.testing.assert_array_equal(out, want)
    dots = np.einsum("spd,spd->sp", x.astype(np.float64), y)
    np.testing.assert_allclose(out, dots, rtol=1e-5, atol=1e-5)


def test_a_tile_refuses_arrays_it_cannot_address() -> None:
    bottom, rows, grad = _sample(2, 16)
    grad_bottom, grad_rows = np.empty_like(bottom), np.empty_like(rows)
    with pytest.raises(Exception, match="(?i)typing"):
        pair_dots_backward(bottom, rows[:, :, ::2], None, grad, grad_bottom[:, :8], grad_rows[:, :, :8])


@pytest.mark.parametrize(("tables", "dim"), SHAPES)
def test_reading_the_unique_rows_by_index_gives_the_same_bits_as_the_gathered_rows(
    tables: int, dim: int
) -> None:
    """With the batch's unique rows and each sample's positions in them, the forward reads the same values
    and the backward adds each sample's row gradients into the unique rows in the order the gather's
    backward does (``_sum_rows``): both the same bits as gathering first."""
    bottom, _, grad = _sample(tables, dim, samples=9)
    rng = np.random.default_rng(tables * dim)
    unique = rng.standard_normal((7, dim), dtype=np.float32)
    inverse = rng.integers(0, unique.shape[0], (bottom.shape[0], tables))
    rows = unique[inverse]  # [samples, tables, dim]
    pairs = (tables + 1) * tables // 2
    gathered, indexed = (np.full((bottom.shape[0], pairs), np.nan, dtype=np.float32) for _ in range(2))
    pair_dots_forward(bottom, rows, None, gathered)
    pair_dots_forward(bottom, unique, inverse, indexed)
    np.testing.assert_array_equal(indexed, gathered)
    grad_bottom, grad_rows = np.empty_like(bottom), np.empty_like(rows)
    pair_dots_backward(bottom, rows, None, grad, grad_bottom, grad_rows)
    summed = np.empty_like(unique)
    _sum_rows(summed, inverse.reshape(-1), grad_rows.reshape(-1, dim))
    grad_bottom_indexed, grad_unique = np.empty_like(bottom), np.full_like(unique, np.nan)
    pair_dots_backward(bottom, unique, inverse, grad, grad_bottom_indexed, grad_unique)
    np.testing.assert_array_equal(grad_bottom_indexed, grad_bottom)
    np.testing.assert_array_equal(grad_unique, summed)


def test_a_position_outside_the_unique_rows_is_refused_before_anything_is_written() -> None:
    bottom, _, grad = _sample(3, 16)
    unique = np.ones((4, 16), dtype=np.float32)
    inverse = np.zeros((bottom.shape[0], 3), dtype=np.int64)
    inverse[2, 1] = 4
    out = np.full((bottom.shape[0], 6), 7.0, dtype=np.float32)
    with pytest.raises(IndexError, match="outside the rows"):
        pair_dots_forward(bottom, unique, inverse, out)
    assert (out == 7.0).all()
    grad_bottom, grad_unique = np.full_like(bottom, 7.0), np.full_like(unique, 7.0)
    inverse[2, 1] = -1
    with pytest.raises(IndexError, match="outside the rows"):
        pair_dots_backward(bottom, unique, inverse, grad, grad_bottom, grad_unique)
    assert (grad_bottom == 7.0).all() and (grad_unique == 7.0).all()


def test_arrays_whose_shapes_disagree_are_refused_before_anything_is_written() -> None:
    bottom, rows, grad = _sample(3, 16)  # 5 samples
    unique = np.ones((4, 16), dtype=np.float32)
    inverse = np.zeros((bottom.shape[0], 3), dtype=np.int64)
    out = np.full((bottom.shape[0], 6), 7.0, dtype=np.float32)
    for args in (
        (bottom, unique, inverse[:4], out),  # an index for fewer samples than the bottom output has
        (bottom, unique[:, :8].copy(), inverse, out),  # unique rows narrower than the bottom output
        (bottom, rows[:4].copy(), None, out),  # rows for fewer samples
        (bottom, unique, inverse, out[:, :5].copy()),  # room for fewer dots than the pairs
    ):
        with pytest.raises(ValueError, match="pair_dots: "):
            pair_dots_forward(*args)
        assert (args[-1] == 7.0).all()
    grad_bottom, grad_unique = np.full_like(bottom, 7.0), np.full((5, 16), 7.0, dtype=np.float32)
    with pytest.raises(ValueError, match="the rows' gradient"):
        pair_dots_backward(bottom, unique, inverse, grad, grad_bottom, grad_unique)
    assert (grad_bottom == 7.0).all() and (grad_unique == 7.0).all()
