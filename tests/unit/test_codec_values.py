"""bagpipe.codec refuses a batch whose values are out of their domain (a dense feature that is not
finite, a label other than 0 and 1, a key outside its column's table), naming the batch and the field,
where the oracle decodes a batch and where a trainer decodes its samples."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from bagpipe.codec import decode_batch, decode_plan
from bagpipe.core.data import BatchArrays, table_offsets
from bagpipe.errors import InvalidArgument
from bagpipe.v1 import data_processor_pb2 as dpb
from bagpipe.wire import to_tensor

from tests.unit.test_codec import BATCH, TABLE_ROWS, TRAINERS, _batch, _batches, _plans


def _changed(arrays: BatchArrays, what: str) -> BatchArrays:
    dense, labels, inverse = arrays.dense.copy(), arrays.labels.copy(), arrays.inverse.copy()
    if what == "nan":
        dense[5, 2] = np.nan
    elif what == "inf":
        dense[7, 0] = -np.inf
    elif what == "label 2":
        labels[3] = 2.0
    elif what == "label -1":
        labels[9] = -1.0
    elif what == "table":  # sample 4's table-1 column points at a key of table 0
        inverse[4, 1] = 0
    return dataclasses.replace(arrays, dense=dense, labels=labels, inverse=inverse)


def _decode(message: dpb.Batch, table_rows=TABLE_ROWS):  # type: ignore[no-untyped-def]
    return decode_batch(
        dpb.Batch.FromString(message.SerializeToString()),
        num_keys=int(table_offsets(TABLE_ROWS)[-1]),
        batch_size=BATCH,
        num_tables=len(TABLE_ROWS),
        trainers=TRAINERS,
        table_rows=table_rows,
    )


@pytest.mark.parametrize(
    ("what", "message"),
    [
        ("nan", "batch 1: dense: sample 5, feature 2: value nan is not finite"),
        ("inf", "batch 1: dense: sample 7, feature 0: value -inf is not finite"),
        ("label 2", "batch 1: labels: sample 3: label 2.0 is not 0 or 1"),
        ("label -1", "batch 1: labels: sample 9: label -1.0 is not 0 or 1"),
        ("table", "batch 1: inverse: sample 4, table 1: row "),
    ],
)
def test_a_batch_with_values_out_of_their_domain_is_refused_naming_batch_and_field(
    what: str, message: str
) -> None:
    arrays, last = _batches(2)[1]
    assert _decode(_batch(arrays, last)[0]).arrays is not None  # the batch as built passes
    with pytest.raises(InvalidArgument) as err:
        _decode(_batch(_changed(arrays, what), last)[0])
    assert str(err.value).startswith(message), str(err.value)


def test_without_table_rows_a_key_of_another_table_is_not_checked() -> None:
    arrays, last = _batches(1)[0]
    assert _decode(_batch(_changed(arrays, "table"), last)[0], table_rows=None).arrays is not None


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("dense", np.nan, "dense: sample 1, feature 3: value nan is not finite"),
        ("dense", np.inf, "dense: sample 1, feature 3: value inf is not finite"),
        ("labels", 2.0, "labels: sample 1: label 2.0 is not 0 or 1"),
        ("labels", -1.0, "labels: sample 1: label -1.0 is not 0 or 1"),
    ],
)
def test_a_trainers_samples_with_values_out_of_their_domain_are_refused(
    field: str, value: float, message: str
) -> None:
    arrays, _, rows, plans, samples, _ = _plans()[1]
    dims = (len(TABLE_ROWS), arrays.dense.shape[1], 0, TRAINERS)
    decode_plan(plans[0], samples[0], rows, *dims)
    bad = dpb.Samples()
    bad.CopyFrom(samples[0])
    values = (arrays.dense if field == "dense" else arrays.labels)[: BATCH // TRAINERS].copy()
    if field == "dense":
        values[1, 3] = value
    else:
        values[1] = value
    getattr(bad, field).CopyFrom(to_tensor(values))
    with pytest.raises(InvalidArgument) as err:
        decode_plan(plans[0], bad, rows, *dims)
    assert str(err.value) == f"batch {arrays.number}: samples: {message}"
