"""The oracle's trainer masks for a batch whose processor did not send them: a key no sample uses is
refused with the batch and the key named (it would have no holder to write it back)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from bagpipe.codec import WireBatch
from bagpipe.core.batches import numbered_batches
from bagpipe.core.data import SyntheticConfig, SyntheticSource
from bagpipe.errors import InvalidArgument
from bagpipe.oracle_cacher.config import OracleConfig
from bagpipe.oracle_cacher.server import Oracle

ROWS = (30, 8, 50)


def test_masks_are_worked_out_and_an_unused_key_is_refused() -> None:
    oracle = Oracle(OracleConfig(ROWS, 8, 2, 2, 1, 4))
    arrays, _ = next(
        iter(numbered_batches(SyntheticSource(SyntheticConfig(table_rows=ROWS)), ROWS, 8, 0, 1, 1))
    )
    users = oracle._users(WireBatch(arrays, last=False, users=None))
    assert users.dtype == np.uint8 and users.shape == arrays.keys.shape and users.all()
    unused = int(arrays.keys[-1]) + 1  # a key past every sample's
    extra = dataclasses.replace(arrays, keys=np.append(arrays.keys, unused))
    with pytest.raises(InvalidArgument, match=rf"batch 0: keys: key {unused} is used by no sample"):
        oracle._users(WireBatch(extra, last=False, users=None))
