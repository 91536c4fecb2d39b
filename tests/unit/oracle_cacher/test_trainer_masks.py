"""The oracle's trainer masks for a batch: with LRPP they come from the data processor (a batch without
them is refused, naming it); a replicated cache gives every key to every trainer. (A key no sample uses
has an empty mask, which ``codec.decode_batch`` refuses: tests/unit/test_codec.py.)"""

from __future__ import annotations

import numpy as np
import pytest
from bagpipe.codec import WireBatch
from bagpipe.errors import InvalidArgument
from bagpipe.oracle_cacher.config import OracleConfig
from bagpipe.oracle_cacher.server import Oracle

ROWS = (30, 8, 50)
KEYS = np.array([1, 4, 33, 70], dtype=np.int64)


def test_lrpp_takes_the_processors_masks_and_refuses_a_batch_without_them() -> None:
    oracle = Oracle(OracleConfig(ROWS, 8, 2, 2, 1, 4))
    sent = np.array([1, 3, 2, 1], dtype=np.uint64)
    users = oracle._users(WireBatch(0, KEYS, last=False, users=sent))
    assert users.dtype == np.uint8 and users.tolist() == [1, 3, 2, 1]
    with pytest.raises(InvalidArgument, match=r"batch 5: users: missing: the data processor sent no masks"):
        oracle._users(WireBatch(5, KEYS, last=False, users=None))


def test_a_replicated_cache_gives_every_key_to_every_trainer() -> None:
    oracle = Oracle(OracleConfig(ROWS, 8, 2, 2, 1, 4, cache_mode="replicated"))
    users = oracle._users(WireBatch(0, KEYS, last=False, users=None))
    assert users.dtype == np.uint8 and users.tolist() == [3, 3, 3, 3]
