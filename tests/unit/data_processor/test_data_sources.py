"""File sources (data_processor/files.py): the vectorised Criteo parser against the contract line by line,
Avazu, the shuffle, and data processors that split a file between them."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
from bagpipe.core.data import DataFormatError
from bagpipe.data_processor.files import (
    AVAZU_HEADER,
    AVAZU_TABLE_ROWS,
    CHUNK_BYTES,
    AvazuConfig,
    AvazuCSVSource,
    CriteoConfig,
    CriteoTSVSource,
    fnv1a64,
)

ROWS = tuple(range(3, 29))  # 26 tables of 3..28 rows


def criteo_lines(n: int, seed: int) -> list[str]:
    """Tricky but valid lines: empty fields, negatives, 18-digit ints, 32-digit and mixed-case hex."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        ints = [rng.choice(["", "0", str(rng.randint(-50, 10**6)), "9" * 18, "-7"]) for _ in range(13)]
        cats = [
            rng.choice(["", f"{rng.getrandbits(32):x}", f"{rng.getrandbits(128):X}", "0", "aBc"])
            for _ in range(26)
        ]
        lines.append("\t".join([str(rng.randint(0, 1)), *ints, *cats]))
    return lines


def by_the_contract(line: str, rows: tuple[int, ...]) -> tuple[float, list[float], list[int]]:
    fields = line.split("\t")
    ints = [max(int(v), 0) if v else 0 for v in fields[1:14]]
    return (
        float(fields[0]),
        list(np.log1p(np.array(ints, dtype=np.float64)).astype(np.float32)),
        [int(v, 16) % r if v else 0 for v, r in zip(fields[14:], rows, strict=True)],
    )


def write(path: Path, lines: list[str], header: str | None = None) -> str:
    path.write_text("".join(f"{line}\n" for line in ([header] if header else []) + lines))
    return str(path)


def test_the_vectorised_criteo_parser_follows_the_contract(tmp_path: Path) -> None:
    lines = criteo_lines(500, seed=1)
    source = CriteoTSVSource(CriteoConfig((write(tmp_path / "d.tsv", lines),), ROWS))
    [(_, samples)] = list(source.batches(500))
    for i, line in enumerate(lines):
        label, dense, sparse = by_the_contract(line, ROWS)
        assert samples.labels[i] == label and samples.sparse[i].tolist() == sparse
        assert samples.dense[i].tolist() == dense


def test_chunks_cut_between_lines_change_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lines = criteo_lines(300, seed=2)
    path = write(tmp_path / "d.tsv", lines)
    whole = list(CriteoTSVSource(CriteoConfig((path,), ROWS)).batches(7))
    monkeypatch.setattr("bagpipe.data_processor.files.CHUNK_BYTES", 997)  # chunks end mid-line
    assert CHUNK_BYTES > 997
    cut = list(CriteoTSVSource(CriteoConfig((path,), ROWS)).batches(7))
    assert [n for n, _ in cut] == [n for n, _ in whole]
    for (_, a), (_, b) in zip(cut, whole, strict=True):
        assert np.array_equal(a.sparse, b.sparse) and np.array_equal(a.dense, b.dense)


@pytest.mark.parametrize("processors", [1, 2, 3])
@pytest.mark.parametrize("shuffle", [None, 5])
def test_processors_together_produce_the_single_reader_batches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, processors: int, shuffle: int | None
) -> None:
    path = write(tmp_path / "d.tsv", criteo_lines(103, seed=3))
    monkeypatch.setattr("bagpipe.data_processor.files.CHUNK_BYTES", 1500)  # windows and batches span chunks
    config = CriteoConfig((path,), ROWS, shuffle_seed=shuffle, shuffle_buffer=17)
    single = {n: (s, last) for n, s, last in CriteoTSVSource(config).numbered(8)}
    assert len(single) == 12 and [n for n, (_, last) in single.items() if last] == [11]
    together = {}
    for i in range(processors):
        for n, s, last in CriteoTSVSource(config).numbered(8, start=i, stride=processors):
            assert n % processors == i and n not in together
            together[n] = (s, last)
    assert sorted(together) == sorted(single)
    for n, (s, last) in together.items():
        assert np.array_equal(s.sparse, single[n][0].sparse) and np.array_equal(s.labels, single[n][0].labels)
        assert last == single[n][1]


def test_a_processor_parses_only_its_own_lines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path / "d.tsv", criteo_lines(400, seed=4))
    monkeypatch.setattr("bagpipe.data_processor.files.CHUNK_BYTES", 4096)
    parsed: list[int] = []
    source = CriteoTSVSource(CriteoConfig((path,), ROWS))
    original = source._parse
    monkeypatch.setattr(
        source, "_parse", lambda buf: (parsed.append(int((buf == 10).sum())), original(buf))[1]
    )
    assert [n for n, _ in source.batches(20, start=1, stride=4)] == [1, 5, 9, 13, 17]
    assert sum(parsed) == 5 * 20, "the other processors' 300 lines are counted, not parsed"


def test_shuffle_is_a_deterministic_permutation_within_windows(tmp_path: Path) -> None:
    lines = [line for line in criteo_lines(60, seed=5)]
    path = write(tmp_path / "d.tsv", lines)
    plain = np.concatenate([s.sparse for _, s in CriteoTSVSource(CriteoConfig((path,), ROWS)).batches(10)])
    shuffled = [
        np.concatenate(
            [
                s.sparse
                for _, s in CriteoTSVSource(
                    CriteoConfig((path,), ROWS, shuffle_seed=seed, shuffle_buffer=25)
                ).batches(10)
            ]
        )
        for seed in (7, 7, 8)
    ]
    assert np.array_equal(shuffled[0], shuffled[1]) and not np.array_equal(shuffled[0], shuffled[2])
    assert not np.array_equal(shuffled[0], plain)
    for lo in (0, 25, 50):  # each window keeps its own samples
        window = slice(lo, min(lo + 25, 60))
        assert sorted(map(tuple, shuffled[0][window])) == sorted(map(tuple, plain[window]))


# ---- Avazu


def avazu_line(i: int, click: str = "0", hour: str = "14102100") -> str:
    return ",".join(
        [
            str(10**18 + i),
            click,
            hour,
            "1005",
            "0",
            f"{i % 7:08x}",
            "f3845767",
            "28905ebd",
            "ecad2386",
            "7801e8d9",
            "07d7df22",
            "a99f214a",
            f"{i:08x}",
            "711ee120",
            "1",
            "0",
            "15706",
            "320",
            "50",
            "1722",
            "0",
            "35",
            "-1",
            "79",
        ]
    )


def test_avazu_parse_hashes_every_field_and_takes_the_hour_of_day(tmp_path: Path) -> None:
    lines = [avazu_line(i, click=str(i % 2), hour=f"141021{i % 24:02d}") for i in range(30)]
    path = write(tmp_path / "train.csv", lines, header=AVAZU_HEADER.decode())
    [(_, samples)] = list(AvazuCSVSource(AvazuConfig((path,), AVAZU_TABLE_ROWS)).batches(30))
    assert samples.sparse.shape == (30, 22) and samples.dense.shape == (30, 1)
    for i, line in enumerate(lines):
        fields = line.split(",")
        assert samples.labels[i] == i % 2
        assert samples.dense[i, 0] == np.float32(np.log1p(i % 24))
        assert samples.sparse[i].tolist() == [
            fnv1a64(v.encode()) % r for v, r in zip(fields[2:], AVAZU_TABLE_ROWS, strict=True)
        ]
    assert (
        fnv1a64(b"") == 0xCBF29CE484222325 and fnv1a64(b"a") == 0xAF63DC4C8601EC8C
    )  # published FNV-1a-64 values


AVAZU_BAD = [
    (avazu_line(0, click="2"), "click", "'2' is not 0 or 1"),
    (avazu_line(0, hour="141021"), "hour", "'141021' is not an hour YYMMDDHH"),
    (avazu_line(0, hour="14102124"), "hour", "'14102124' is not an hour YYMMDDHH"),
    (avazu_line(0) + ",x", "fields", "has 25 comma-separated fields, expected 24"),
]


@pytest.mark.parametrize(("bad", "field", "reason"), AVAZU_BAD)
def test_avazu_malformed_lines_are_named_or_skipped(
    tmp_path: Path, bad: str, field: str, reason: str
) -> None:
    lines = [avazu_line(i) for i in range(4)]
    lines.insert(2, bad)
    path = write(tmp_path / "train.csv", lines, header=AVAZU_HEADER.decode())
    with pytest.raises(DataFormatError) as caught:
        list(AvazuCSVSource(AvazuConfig((path,), AVAZU_TABLE_ROWS)).batches(2))
    error = caught.value
    assert (error.path, error.line, error.field) == (path, 4, field) and str(error).endswith(reason)
    source = AvazuCSVSource(AvazuConfig((path,), AVAZU_TABLE_ROWS, skip_bad_rows=True))
    assert [n for n, _ in source.batches(2)] == [0, 1] and source.bad_rows == 1


def test_avazu_header_is_checked(tmp_path: Path) -> None:
    path = write(tmp_path / "train.csv", [avazu_line(0)], header="id,click,hour,C1,oops")
    with pytest.raises(DataFormatError, match=r"train.csv:1: field header: .* is not Avazu's header"):
        list(AvazuCSVSource(AvazuConfig((path,), AVAZU_TABLE_ROWS)).batches(1))
    headless = write(tmp_path / "part.csv", [avazu_line(0), avazu_line(1)])
    assert len(list(AvazuCSVSource(AvazuConfig((headless,), AVAZU_TABLE_ROWS)).batches(1))) == 2
    with pytest.raises(ValueError, match="table_rows: must have 22 values, got 26"):
        AvazuConfig((headless,), ROWS)
