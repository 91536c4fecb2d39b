"""Values and lines at the edges of the data contract: long fields hash by FNV-1a over every byte, a line
over the limit is named or skipped, memory stays within a chunk, and values out of their domain are
refused where they are parsed."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from bagpipe.core.data import DataFormatError, Samples
from bagpipe.data_processor import files
from bagpipe.data_processor.files import (
    AVAZU_HEADER,
    AVAZU_TABLE_ROWS,
    MAX_LINE_BYTES,
    AvazuConfig,
    AvazuCSVSource,
    CriteoConfig,
    CriteoTSVSource,
)

ROWS = tuple([10] * 26)


def _fnv1a64(value: bytes) -> int:
    """The reference: FNV-1a-64 as its authors define it, one byte at a time."""
    h = 0xCBF29CE484222325
    for byte in value:
        h = ((h ^ byte) * 0x100000001B3) % 2**64
    return h


def _avazu(i: int, site_id: str = "1fbe01fe", click: str = "0") -> str:
    cols = [str(i), click, "14102100", "1005", "0", site_id, "f3845767", "28905ebd", "ecad2386"]
    cols += ["7801e8d9", "07d7df22", "a99f214a", "ddd2926e", "44956a24", "1", "2", "15706", "320"]
    cols += ["50", "1722", "0", "35", "-1", "79"]
    return ",".join(cols)


def _criteo(label: str = "1", dense: str = "3", cat: str = "a1b2") -> str:
    return label + "\t" + "\t".join([dense] * 13) + "\t" + "\t".join([cat] * 26)


def _all(source: CriteoTSVSource | AvazuCSVSource) -> Samples:
    parts = [samples for _, samples in source.batches(1)]
    return Samples(
        dense=np.concatenate([p.dense for p in parts]),
        sparse=np.concatenate([p.sparse for p in parts]),
        labels=np.concatenate([p.labels for p in parts]),
    )


def test_a_100_kb_field_hashes_by_fnv1a_over_every_byte(tmp_path: Path) -> None:
    long = "".join(chr(97 + i % 26) for i in range(100_000))
    path = tmp_path / "long.csv"
    path.write_text(f"{AVAZU_HEADER.decode()}\n{_avazu(0)}\n{_avazu(1, site_id=long)}\n")
    samples = _all(AvazuCSVSource(AvazuConfig(paths=(str(path),), table_rows=AVAZU_TABLE_ROWS)))
    site = AVAZU_HEADER.decode().split(",").index("site_id") - 2  # (its table)
    assert samples.sparse[1, site] == _fnv1a64(long.encode()) % AVAZU_TABLE_ROWS[site]
    assert samples.sparse[0, site] == _fnv1a64(b"1fbe01fe") % AVAZU_TABLE_ROWS[site]
    # two fields equal in their first 64 KiB hash apart
    assert _fnv1a64(long.encode()) != _fnv1a64(long[: 1 << 16].encode())


def test_one_long_field_does_not_pad_the_chunk_to_its_width(tmp_path: Path) -> None:
    lines = [_avazu(i) for i in range(3000)]
    lines[1500] = _avazu(1500, site_id="x" * 1000)
    data = AVAZU_HEADER.decode() + "\n" + "\n".join(lines) + "\n"
    path = tmp_path / "wide.csv"
    path.write_text(data)
    source = AvazuCSVSource(AvazuConfig(paths=(str(path),), table_rows=AVAZU_TABLE_ROWS))
    _all(source)  # (compiles the hash first, outside the measurement)
    tracemalloc.start()
    try:
        samples = _all(source)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(samples) == 3000
    # padded to 1,000 bytes, every field of the chunk would take 3000 * 22 * 1000 * 8 B = 528 MB
    assert peak < 40 * len(data), (peak, len(data))


@pytest.mark.parametrize("chunk", [files.CHUNK_BYTES, 700])
def test_a_line_over_the_limit_is_named_by_file_and_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk: int
) -> None:
    monkeypatch.setattr(files, "MAX_LINE_BYTES", 1000)
    monkeypatch.setattr(files, "CHUNK_BYTES", chunk)  # 700: the line's end is not read before the limit
    path = tmp_path / "long.tsv"
    path.write_text("\n".join([_criteo(), _criteo(), _criteo(cat="a" * 2000), _criteo()]) + "\n")
    with pytest.raises(DataFormatError, match=rf"{path}:3: field line: .* longer than 1000 bytes") as err:
        list(CriteoTSVSource(CriteoConfig(paths=(str(path),), table_rows=ROWS)).batches(1))
    assert (err.value.path, err.value.line, err.value.field) == (str(path), 3, "line")


def test_the_default_line_limit_is_one_mib(tmp_path: Path) -> None:
    assert MAX_LINE_BYTES == 1 << 20
    path = tmp_path / "long.csv"
    path.write_text(f"{_avazu(0)}\n{_avazu(1, site_id='y' * MAX_LINE_BYTES)}\n")
    with pytest.raises(DataFormatError, match=rf"{path}:2: field line"):
        list(AvazuCSVSource(AvazuConfig(paths=(str(path),), table_rows=AVAZU_TABLE_ROWS)).batches(1))


@pytest.mark.parametrize("chunk", [files.CHUNK_BYTES, 700, 1300])
def test_lines_over_the_limit_are_skipped_with_skip_bad_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk: int
) -> None:
    monkeypatch.setattr(files, "MAX_LINE_BYTES", 1000)
    monkeypatch.setattr(files, "CHUNK_BYTES", chunk)
    good = [_criteo(label=str(i % 2), dense=str(i)) for i in range(8)]
    lines = good[:2] + [_criteo(cat="b" * 3000)] + good[2:5] + [_criteo(cat="c" * 1200)] + good[5:]
    lines.append("1\t" + "5" * 5000)  # the last line, without its newline
    path = tmp_path / "long.tsv"
    path.write_text("\n".join(lines))
    clean = tmp_path / "clean.tsv"
    clean.write_text("\n".join(good) + "\n")
    source = CriteoTSVSource(CriteoConfig(paths=(str(path),), table_rows=ROWS, skip_bad_rows=True))
    got = _all(source)
    want = _all(CriteoTSVSource(CriteoConfig(paths=(str(clean),), table_rows=ROWS)))
    assert source.bad_rows == 3
    for name in ("dense", "sparse", "labels"):
        assert np.array_equal(getattr(got, name), getattr(want, name)), name


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("nan", "I1: 'nan' is not finite"),
        ("-inf", "I1: '-inf' is not finite"),
        ("Infinity", "I1: 'Infinity' is not finite"),
    ],
)
def test_non_finite_dense_text_is_named(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "nan.tsv"
    bad = _criteo().split("\t")
    bad[1] = text
    path.write_text(_criteo() + "\n" + "\t".join(bad) + "\n")
    with pytest.raises(DataFormatError, match=rf"{path}:2: field {message}"):
        list(CriteoTSVSource(CriteoConfig(paths=(str(path),), table_rows=ROWS)).batches(1))


def _corrupting(parse, what: str):  # type: ignore[no-untyped-def]
    """``parse`` with sample 2 of each chunk given a value out of its domain."""

    def corrupted(self, buf):  # type: ignore[no-untyped-def]
        samples, valid = parse(self, buf)
        dense, sparse, labels = samples.dense.copy(), samples.sparse.copy(), samples.labels.copy()
        if what == "dense":
            dense[2, 4] = np.nan
        elif what == "label":
            labels[2] = 2.0
        else:
            sparse[2, 7] = 10
        return Samples(dense=dense, sparse=sparse, labels=labels), valid

    return corrupted


@pytest.mark.parametrize(
    ("what", "message"),
    [
        ("dense", r"field I5: '3' gives dense value nan, which is not finite"),
        ("label", r"field label: '1' gives label 2.0, which is not 0 or 1"),
        ("sparse", r"field C8: 'a1b2' gives row 10, outside its table's \[0, 10\)"),
    ],
)
def test_values_out_of_their_domain_after_the_parse_are_named_or_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, what: str, message: str
) -> None:
    """Whatever a parse yields is checked again column-wise: the first bad sample is traced back to its
    file, line and column; a malformed line before it is named first."""
    monkeypatch.setattr(CriteoTSVSource, "_parse", _corrupting(CriteoTSVSource._parse, what))
    lines = [_criteo(), "x", _criteo(), _criteo(), _criteo(label="0")]
    path = tmp_path / "values.tsv"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataFormatError, match=rf"{path}:2: field fields"):
        list(CriteoTSVSource(CriteoConfig(paths=(str(path),), table_rows=ROWS)).batches(1))
    del lines[1]
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataFormatError, match=rf"{path}:3: {message}"):
        list(CriteoTSVSource(CriteoConfig(paths=(str(path),), table_rows=ROWS)).batches(1))
    source = CriteoTSVSource(CriteoConfig(paths=(str(path),), table_rows=ROWS, skip_bad_rows=True))
    got = _all(source)
    assert source.bad_rows == 1 and len(got) == 3
    assert got.labels.tolist() == [1.0, 1.0, 0.0]  # lines 1, 2 and 4


def test_a_row_outside_its_table_names_the_batch_sample_and_table() -> None:
    from bagpipe.core.data import build_batch, table_offsets

    samples = Samples(
        dense=np.zeros((3, 1), np.float32),
        sparse=np.array([[0, 1], [2, 5], [1, 1]], dtype=np.int64),
        labels=np.zeros(3, np.float32),
    )
    with pytest.raises(ValueError, match=r"^batch 7: sparse: sample 1, table 1: row 5 outside \[0, 4\)$"):
        build_batch(7, samples, table_offsets([3, 4]))
