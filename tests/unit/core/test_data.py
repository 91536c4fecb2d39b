"""Tests for bagpipe.core.data: synthetic generator, Criteo TSV reader and batch key extraction."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
from bagpipe.core import dedup
from bagpipe.core.data import (
    KAGGLE_TABLE_ROWS,
    NUM_DENSE,
    NUM_TABLES,
    BatchArrays,
    DataFormatError,
    Samples,
    SyntheticConfig,
    SyntheticSource,
    build_batch,
    scaled_table_rows,
    table_offsets,
)
from bagpipe.data_processor.files import CriteoConfig, CriteoTSVSource

SMALL_ROWS = (50, 40, 30, 20, 1000, 7)

# ---------------------------------------------------------------------------------------------------
# Table sizes


def test_kaggle_table_rows_has_one_cardinality_per_table() -> None:
    assert len(KAGGLE_TABLE_ROWS) == NUM_TABLES
    assert KAGGLE_TABLE_ROWS[2] == 10131227


def test_scaled_table_rows_stays_between_floor_and_base() -> None:
    for scale in (1e-6, 0.001, 0.3):
        scaled = scaled_table_rows(scale)
        assert len(scaled) == NUM_TABLES
        for rows, base in zip(scaled, KAGGLE_TABLE_ROWS, strict=True):
            assert min(base, 4) <= rows <= base
    assert scaled_table_rows(0.5, [10, 3, 1000, 1]) == [5, 3, 500, 1]
    assert scaled_table_rows(0.001, [10, 3, 1000]) == [4, 3, 4]
    assert scaled_table_rows(3.0) == list(KAGGLE_TABLE_ROWS)


@pytest.mark.parametrize("scale", [0.0, -1.0, float("nan"), float("inf")])
def test_scaled_table_rows_rejects_bad_scale(scale: float) -> None:
    with pytest.raises(ValueError, match="scale"):
        scaled_table_rows(scale)


def test_table_offsets_are_cumulative_from_zero() -> None:
    offsets = table_offsets([3, 5, 2])
    assert offsets.dtype == np.int64
    assert offsets.tolist() == [0, 3, 8, 10]
    assert table_offsets([]).tolist() == [0]


# ---------------------------------------------------------------------------------------------------
# Synthetic data


def _assert_samples_equal(a: Samples, b: Samples) -> None:
    np.testing.assert_array_equal(a.dense, b.dense)
    np.testing.assert_array_equal(a.sparse, b.sparse)
    np.testing.assert_array_equal(a.labels, b.labels)


def test_synthetic_batch_depends_only_on_config_number_and_size() -> None:
    config = SyntheticConfig(SMALL_ROWS, seed=7)
    first = SyntheticSource(config)
    for number in range(5):
        first.batch(number, 64)
    again = first.batch(3, 64)
    fresh = SyntheticSource(SyntheticConfig(SMALL_ROWS, seed=7)).batch(3, 64)
    _assert_samples_equal(again, fresh)
    _assert_samples_equal(first.batch(3, 64), again)


def test_synthetic_batches_differ_across_numbers_and_seeds() -> None:
    source = SyntheticSource(SyntheticConfig(SMALL_ROWS, seed=7))
    other_seed = SyntheticSource(SyntheticConfig(SMALL_ROWS, seed=8))
    a, b = source.batch(0, 256), source.batch(1, 256)
    assert not np.array_equal(a.sparse, b.sparse)
    assert not np.array_equal(a.dense, b.dense)
    assert not np.array_equal(a.sparse, other_seed.batch(0, 256).sparse)


@pytest.mark.parametrize(
    "config",
    [
        SyntheticConfig(SMALL_ROWS + (1, 2, 3)),
        SyntheticConfig(SMALL_ROWS + (1, 2, 3), hot_fraction=0.1, hot_share=0.8),
        SyntheticConfig(SMALL_ROWS + (1, 2, 3), hot_fraction=1.0, hot_share=0.3),
    ],
)
def test_synthetic_samples_have_contract_shapes_and_ranges(config: SyntheticConfig) -> None:
    samples = SyntheticSource(config).batch(2, 500)
    assert len(samples) == 500
    assert samples.dense.dtype == np.float32 and samples.dense.shape == (500, NUM_DENSE)
    assert samples.sparse.dtype == np.int64 and samples.sparse.shape == (500, len(config.table_rows))
    assert samples.labels.dtype == np.float32 and samples.labels.shape == (500,)
    assert (samples.sparse >= 0).all()
    assert (samples.sparse < np.array(config.table_rows)).all()
    assert set(np.unique(samples.labels).tolist()) <= {0.0, 1.0}
    counts = np.expm1(samples.dense.astype(np.float64))
    assert (counts >= 0).all()
    np.testing.assert_allclose(counts, np.round(counts), rtol=1e-5, atol=1e-3)


def test_zipf_skew_gives_the_top_row_far_more_than_a_uniform_share() -> None:
    rows = 100_000
    samples = SyntheticSource(SyntheticConfig((rows,), zipf_alpha=1.2)).batch(0, 20_000)
    counts = np.bincount(samples.sparse[:, 0], minlength=rows)
    top_share = counts.max() / counts.sum()
    assert top_share > 10_000 / rows  # 10,000x the uniform share; Zipf(1.2) gives about 0.2
    hottest = np.argsort(counts)[-10:]
    assert hottest.max() - hottest.min() > rows // 10  # hot rows are scattered over the id space


def test_hot_cold_skew_sends_hot_share_of_accesses_to_hot_fraction_of_rows() -> None:
    rows = 100_000
    config = SyntheticConfig((rows,), hot_fraction=0.01, hot_share=0.9)
    samples = SyntheticSource(config).batch(0, 20_000)
    counts = np.bincount(samples.sparse[:, 0], minlength=rows)
    hot_rows = 1000
    share = np.sort(counts)[-hot_rows:].sum() / counts.sum()
    assert share == pytest.approx(0.9, abs=0.015)
    assert (counts > 0).sum() > hot_rows  # cold rows are drawn too


def test_hot_cold_overrides_zipf_when_both_hot_fields_are_set() -> None:
    hot = SyntheticSource(SyntheticConfig((1000,), zipf_alpha=3.0, hot_fraction=1.0, hot_share=1.0))
    counts = np.bincount(hot.batch(0, 10_000).sparse[:, 0], minlength=1000)
    assert counts.max() < 40  # uniform over 1000 rows: about 10 each, far from Zipf(3)'s ~83%


def _auc(scores: np.ndarray, labels: np.ndarray) -> float:
    pos, neg = scores[labels == 1], scores[labels == 0]
    wins = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    return float(wins / (pos.size * neg.size))


def test_synthetic_labels_are_learnable_from_rows() -> None:
    config = SyntheticConfig(SMALL_ROWS, seed=11, hot_fraction=1.0, hot_share=1.0)
    source = SyntheticSource(config)
    train = [source.batch(n, 2000) for n in range(20)]
    sparse = np.concatenate([s.sparse for s in train])
    labels = np.concatenate([s.labels for s in train]).astype(np.float64)
    base_rate = labels.mean()
    assert 0.05 < base_rate < 0.6
    base_logit = np.log(base_rate / (1 - base_rate))
    # Additive per-row log-odds, fitted by counting: a crude model that must still beat chance clearly.
    row_logits = []
    for t, rows in enumerate(config.table_rows[:2]):
        clicks = np.bincount(sparse[:, t], weights=labels, minlength=rows)
        seen = np.bincount(sparse[:, t], minlength=rows)
        ctr = (clicks + base_rate) / (seen + 1.0)
        row_logits.append(np.log(ctr / (1 - ctr)) - base_logit)
    test = source.batch(1000, 2000)
    scores = sum(row_logits[t][test.sparse[:, t]] for t in range(2))
    assert _auc(np.asarray(scores), test.labels) > 0.62
    assert _auc(test.sparse[:, 4].astype(np.float64), test.labels) == pytest.approx(0.5, abs=0.06)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"table_rows": ()}, "table_rows"),
        ({"table_rows": (10, 0)}, "table_rows"),
        ({"seed": -1}, "seed"),
        ({"zipf_alpha": 0.0}, r"zipf_alpha: must be a finite number > 0, got 0.0"),
        ({"zipf_alpha": -1.0}, "zipf_alpha"),
        ({"zipf_alpha": float("nan")}, "zipf_alpha"),
        ({"zipf_alpha": None}, "zipf_alpha"),
        ({"hot_fraction": 0.1}, "hot_fraction/hot_share: set both or neither"),
        ({"hot_share": 0.9}, "hot_fraction/hot_share"),
        ({"hot_fraction": 0.0, "hot_share": 0.9}, r"hot_fraction: must be in \(0, 1\], got 0.0"),
        ({"hot_fraction": 1.5, "hot_share": 0.9}, "hot_fraction"),
        ({"hot_fraction": 0.1, "hot_share": 1.5}, r"hot_share: must be in \[0, 1\], got 1.5"),
        ({"hot_fraction": 0.1, "hot_share": -0.1}, "hot_share"),
    ],
)
def test_synthetic_config_rejects_bad_values_naming_the_field(
    kwargs: dict[str, object], message: str
) -> None:
    args: dict[str, object] = {"table_rows": (10, 20)} | kwargs
    with pytest.raises(ValueError, match=message):
        SyntheticConfig(**args)  # type: ignore[arg-type]


def test_synthetic_batch_rejects_bad_arguments() -> None:
    source = SyntheticSource(SyntheticConfig((10,)))
    with pytest.raises(ValueError, match="number"):
        source.batch(-1, 8)
    with pytest.raises(ValueError, match="batch_size"):
        source.batch(0, 0)


def test_samples_reject_arrays_off_contract() -> None:
    good = SyntheticSource(SyntheticConfig((10, 10))).batch(0, 4)
    with pytest.raises(ValueError, match="dense"):
        Samples(good.dense.astype(np.float64), good.sparse, good.labels)
    with pytest.raises(ValueError, match="sparse"):
        Samples(good.dense, good.sparse[:3], good.labels)
    with pytest.raises(ValueError, match="labels"):
        Samples(good.dense, good.sparse, good.labels.astype(np.int64))


# ---------------------------------------------------------------------------------------------------
# Batch key extraction


@pytest.mark.parametrize("mark_rows", [dedup.MARK_ROWS, 50, 0])
def test_build_batch_round_trips_keys_and_inverse(monkeypatch: pytest.MonkeyPatch, mark_rows: int) -> None:
    """Tables deduplicated by marking rows, by sorting the column (more rows than ``MARK_ROWS``), and a
    batch with both kinds give the keys and inverse ``np.unique`` gives."""
    monkeypatch.setattr(dedup, "MARK_ROWS", mark_rows)
    rows = SMALL_ROWS + (1, 3)
    offsets = table_offsets(rows)
    samples = SyntheticSource(SyntheticConfig(rows, seed=5)).batch(4, 300)
    batch = build_batch(4, samples, offsets)
    assert isinstance(batch, BatchArrays) and batch.number == 4
    assert batch.keys.dtype == np.int64 and batch.inverse.dtype == np.int32
    assert batch.inverse.shape == samples.sparse.shape
    assert (np.diff(batch.keys) > 0).all()
    global_keys = samples.sparse + offsets[:-1]
    np.testing.assert_array_equal(batch.keys[batch.inverse], global_keys)
    np.testing.assert_array_equal(batch.keys, np.unique(global_keys))
    assert batch.dense is samples.dense and batch.labels is samples.labels


def test_build_batch_rejects_rows_outside_their_table_and_bad_offsets() -> None:
    samples = Samples(
        dense=np.zeros((2, NUM_DENSE), dtype=np.float32),
        sparse=np.array([[0, 3], [1, 2]], dtype=np.int64),
        labels=np.zeros(2, dtype=np.float32),
    )
    with pytest.raises(ValueError, match="sparse"):
        build_batch(0, samples, table_offsets([5, 3]))
    with pytest.raises(ValueError, match="offsets"):
        build_batch(0, samples, table_offsets([5, 3, 4]))
    batch = build_batch(0, samples, table_offsets([5, 4]))
    assert batch.keys.tolist() == [0, 1, 7, 8]
    assert batch.inverse.tolist() == [[0, 3], [1, 2]]


# ---------------------------------------------------------------------------------------------------
# Criteo TSV

ROWS = tuple(range(100, 100 + NUM_TABLES))


def _line(label: str = "0", ints: dict[int, str] | None = None, cats: dict[int, str] | None = None) -> str:
    """A Criteo line; ``ints``/``cats`` override I_k / C_k (1-based), the rest are '1' and 'a'."""
    dense = ["1"] * NUM_DENSE
    sparse = ["a"] * NUM_TABLES
    for k, value in (ints or {}).items():
        dense[k - 1] = value
    for k, value in (cats or {}).items():
        sparse[k - 1] = value
    return "\t".join([label, *dense, *sparse])


def _numbered(first: int, count: int) -> list[str]:
    """Lines whose I1 is the sample's index in the stream and label its parity."""
    return [_line(str(i % 2), ints={1: str(i)}) for i in range(first, first + count)]


def _write(path: Path, lines: list[str], newline: str = "\n") -> str:
    path.write_text("".join(line + newline for line in lines))
    return str(path)


def _indices(samples: Samples) -> list[int]:
    return np.rint(np.expm1(samples.dense[:, 0].astype(np.float64))).astype(int).tolist()


def test_criteo_parses_values_per_contract(tmp_path: Path) -> None:
    line = _line(
        "1",
        ints={1: "5", 2: "-3", 3: "", 4: "0", 13: "1000000"},
        cats={1: "ff", 2: "", 3: "10", 4: "DEADBEEF", 26: "0"},
    )
    path = _write(tmp_path / "day_0.tsv", [line, _line("0")], newline="\r\n")
    source = CriteoTSVSource(CriteoConfig((path,), ROWS))
    [(number, samples)] = list(source.batches(2))
    assert number == 0
    assert samples.labels.dtype == np.float32 and samples.labels.tolist() == [1.0, 0.0]
    expected_counts = np.ones(NUM_DENSE)
    expected_counts[[0, 1, 2, 3, 12]] = [5, 0, 0, 0, 1_000_000]
    np.testing.assert_allclose(samples.dense[0], np.log1p(expected_counts).astype(np.float32))
    assert samples.dense.dtype == np.float32
    expected_rows = [10 % rows for rows in ROWS]
    expected_rows[:4] = [255 % ROWS[0], 0, 16 % ROWS[2], 0xDEADBEEF % ROWS[3]]
    expected_rows[25] = 0
    assert samples.sparse.dtype == np.int64
    assert samples.sparse[0].tolist() == expected_rows
    assert source.samples_read == 2 and source.bad_rows == 0


def test_criteo_numbers_batches_and_drops_partial_last_batch(tmp_path: Path) -> None:
    path = _write(tmp_path / "day_0.tsv", _numbered(0, 10))
    source = CriteoTSVSource(CriteoConfig((path,), ROWS))
    batches = list(source.batches(3))
    assert [number for number, _ in batches] == [0, 1, 2]
    assert [_indices(s) for _, s in batches] == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert batches[1][1].labels.tolist() == [1.0, 0.0, 1.0]
    assert source.samples_read == 10


def test_criteo_start_skips_earlier_batches(tmp_path: Path) -> None:
    path = _write(tmp_path / "day_0.tsv", _numbered(0, 10))
    source = CriteoTSVSource(CriteoConfig((path,), ROWS))
    batches = list(source.batches(3, start=2))
    assert [(number, _indices(s)) for number, s in batches] == [(2, [6, 7, 8])]
    assert list(source.batches(3, start=4)) == []


def test_criteo_concatenates_files_in_order(tmp_path: Path) -> None:
    first = _write(tmp_path / "day_0.tsv", _numbered(0, 4))
    second = _write(tmp_path / "day_1.tsv", _numbered(4, 5))
    source = CriteoTSVSource(CriteoConfig((first, second), ROWS))
    batches = list(source.batches(3))
    assert [(number, _indices(s)) for number, s in batches] == [
        (0, [0, 1, 2]),
        (1, [3, 4, 5]),
        (2, [6, 7, 8]),
    ]


BAD_LINES = [
    (_line("2"), "label", "'2' is not 0 or 1"),
    (_line("", ints={1: "7"}), "label", "'' is not 0 or 1"),
    (_line("0", ints={3: "abc"}), "I3", "'abc' is not an integer"),
    (_line("0", ints={13: "1.5"}), "I13", "'1.5' is not an integer"),
    (_line("0", ints={2: "-"}), "I2", "'-' is not an integer"),
    (_line("0", cats={3: "zz12"}), "C3", "'zz12' is not hexadecimal"),
    (_line("0", cats={26: "0x1f"}), "C26", "'0x1f' is not hexadecimal"),
    (_line("0").rsplit("\t", 1)[0], "fields", "has 39 tab-separated fields, expected 40"),
    (_line("0") + "\tff", "fields", "has 41 tab-separated fields, expected 40"),
    ("", "fields", "has 1 tab-separated fields, expected 40"),
]


@pytest.mark.parametrize(("bad", "field", "reason"), BAD_LINES)
def test_criteo_malformed_line_raises_with_location(
    tmp_path: Path, bad: str, field: str, reason: str
) -> None:
    first = _write(tmp_path / "day_0.tsv", _numbered(0, 2))
    second = _write(tmp_path / "day_1.tsv", [*_numbered(2, 2), bad, *_numbered(4, 2)])
    source = CriteoTSVSource(CriteoConfig((first, second), ROWS))
    with pytest.raises(DataFormatError) as caught:
        list(source.batches(2))
    error = caught.value
    assert (error.path, error.line, error.field) == (second, 3, field)
    assert str(error).startswith(f"{second}:3: field {field}: ")
    assert str(error).endswith(reason)


def test_criteo_malformed_line_is_reported_by_the_processor_whose_batch_holds_it(tmp_path: Path) -> None:
    """Processors parse only their own batches' lines (the others' are counted), so the owner reports it."""
    path = _write(tmp_path / "day_0.tsv", [_line("0"), _line("x"), *_numbered(0, 6)])
    with pytest.raises(DataFormatError, match="day_0.tsv:2: field label"):
        list(CriteoTSVSource(CriteoConfig((path,), ROWS)).batches(2, start=0, stride=2))
    others = list(CriteoTSVSource(CriteoConfig((path,), ROWS)).batches(2, start=1, stride=2))
    assert [(number, _indices(s)) for number, s in others] == [(1, [0, 1]), (3, [4, 5])]


def test_criteo_skip_bad_rows_counts_and_drops_them(tmp_path: Path) -> None:
    lines = _numbered(0, 7)
    lines.insert(1, _line("0", cats={5: "xyz"}))
    lines.insert(5, _line("0", ints={1: "1e3"}))
    path = _write(tmp_path / "day_0.tsv", lines)
    source = CriteoTSVSource(CriteoConfig((path,), ROWS, skip_bad_rows=True))
    batches = list(source.batches(2, start=1))
    assert [(number, _indices(s)) for number, s in batches] == [(1, [2, 3]), (2, [4, 5])]
    assert source.bad_rows == 2
    assert source.samples_read == 7


def test_data_format_error_reads_like_a_compiler_message() -> None:
    error = DataFormatError("day_0.tsv", 17, "C3", "zz12", "is not hexadecimal")
    assert str(error) == "day_0.tsv:17: field C3: 'zz12' is not hexadecimal"
    assert isinstance(error, ValueError)
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.path, copy.line, copy.field, copy.value, copy.reason) == (
        "day_0.tsv",
        17,
        "C3",
        "zz12",
        "is not hexadecimal",
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"paths": ()}, "paths"),
        ({"table_rows": (10,) * (NUM_TABLES - 1)}, "table_rows: must have 26 values, got 25"),
        ({"table_rows": (0,) * NUM_TABLES}, "table_rows"),
    ],
)
def test_criteo_config_rejects_bad_values(kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = {"paths": ("a.tsv",), "table_rows": ROWS} | kwargs
    with pytest.raises(ValueError, match=message):
        CriteoConfig(**args)  # type: ignore[arg-type]


def test_criteo_batches_rejects_bad_arguments(tmp_path: Path) -> None:
    source = CriteoTSVSource(CriteoConfig((_write(tmp_path / "d.tsv", _numbered(0, 2)),), ROWS))
    with pytest.raises(ValueError, match="batch_size"):
        list(source.batches(0))
    with pytest.raises(ValueError, match="start"):
        list(source.batches(2, start=-1))
