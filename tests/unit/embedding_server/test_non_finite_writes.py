"""A non-finite gradient, under every optimizer, makes rows or state that the embedding server refuses
before it changes anything: no row, no state, no flag."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from bagpipe.core.data import table_offsets
from bagpipe.core.optim import OPTIMIZERS, OptimizerConfig, apply_rows
from bagpipe.core.shard_map import ShardMap
from bagpipe.embedding_server.shard_store import ShardStore
from bagpipe.errors import InvalidArgument

DIM = 4
KEYS = np.array([3, 17, 42, 61], dtype=np.int64)


def _store(config: OptimizerConfig) -> ShardStore:
    shard_map = ShardMap.create(80, 1, num_buckets=8)
    store = ShardStore(shard_map, 0, table_offsets([50, 30]), DIM, config.state_width(DIM), seed=1)
    store.non_negative = config.non_negative_columns(DIM)  # (as the server's __main__ sets it)
    return store


def _step(store: ShardStore, config: OptimizerConfig, grad: np.ndarray, step: int, compiled: bool) -> None:
    """A trainer's round trip: look the rows up, apply the optimizer, write them back."""
    rows, state = (torch.from_numpy(a.copy()) for a in store.lookup(KEYS))
    index = torch.arange(KEYS.size, dtype=torch.int64)
    apply_rows(config, rows, state, index, torch.from_numpy(grad), step=step, compiled=compiled)
    store.write(KEYS, rows.numpy(), state.numpy())


def _snapshot(store: ShardStore) -> tuple[bytes, bytes, bytes]:
    return store.table.tobytes(), store._initial.tobytes(), store._changed.tobytes()


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_non_finite_gradient_is_refused_by_the_server_under_every_optimizer(
    name: str, bad: float, compiled: bool
) -> None:
    config = OptimizerConfig(name=name, lr=0.05)
    store = _store(config)
    rng = np.random.default_rng(0)
    _step(store, config, rng.standard_normal((KEYS.size, DIM)).astype(np.float32), 1, compiled)
    before = _snapshot(store)
    grad = rng.standard_normal((KEYS.size, DIM)).astype(np.float32)
    grad[2, 1] = bad
    with pytest.raises(InvalidArgument, match=rf"^(rows|state): key {KEYS[2]}: value"):
        _step(store, config, grad, 2, compiled)
    assert _snapshot(store) == before
    _step(store, config, np.ones((KEYS.size, DIM), np.float32), 2, compiled)  # and it still takes good rows
    assert _snapshot(store) != before


@pytest.mark.parametrize("column", ["rows", "state"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_non_finite_row_or_state_is_refused_under_every_optimizer(
    name: str, bad: float, column: str
) -> None:
    config = OptimizerConfig(name=name)
    store = _store(config)
    if column == "state" and not store.state_width:
        pytest.skip("sgd keeps no state")
    rows, state = (a.copy() for a in store.lookup(KEYS))
    store.write(KEYS, rows, state)
    before = _snapshot(store)
    (rows if column == "rows" else state)[3, -1] = bad
    with pytest.raises(InvalidArgument, match=rf"^{column}: key {KEYS[3]}: value"):
        store.write(KEYS, rows, state)
    assert _snapshot(store) == before
