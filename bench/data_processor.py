"""Parsing throughput of one data processor: samples per second from Criteo TSV and Avazu CSV files into
global batches of the quick profile (2,048), alone and as one of two processors that split the file.

    .venv/bin/python bench/data_processor.py [--lines 500000]

Writes Criteo-like and Avazu-like files (random values in the real formats) to a temporary directory,
then times ``FileSource.numbered`` plus ``build_batch`` (what a processor does before sending a batch).
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "services"))

from bagpipe.core.data import KAGGLE_TABLE_ROWS, build_batch, table_offsets  # noqa: E402
from bagpipe.data_processor.files import (  # noqa: E402
    AVAZU_HEADER,
    AVAZU_TABLE_ROWS,
    AvazuConfig,
    AvazuCSVSource,
    CriteoConfig,
    CriteoTSVSource,
)


def criteo_file(path: Path, lines: int) -> None:
    rng = random.Random(0)
    with path.open("w") as f:
        for _ in range(lines):
            ints = ["" if rng.random() < 0.2 else str(int(rng.expovariate(0.05))) for _ in range(13)]
            cats = ["" if rng.random() < 0.05 else format(rng.getrandbits(32), "08x") for _ in range(26)]
            f.write("\t".join([str(rng.randint(0, 1)), *ints, *cats]) + "\n")


def avazu_file(path: Path, lines: int) -> None:
    rng = random.Random(0)
    with path.open("w") as f:
        f.write(AVAZU_HEADER.decode() + "\n")
        for i in range(lines):
            cats = [format(rng.getrandbits(32), "08x") for _ in range(8)] + [
                str(rng.randint(0, 3000)) for _ in range(11)
            ]
            f.write(
                ",".join(
                    [
                        str(10**18 + i),
                        str(rng.randint(0, 1)),
                        f"141021{rng.randint(0, 23):02d}",
                        "1005",
                        *cats[:1],
                        *cats,
                    ]
                )
                + "\n"
            )


def measure(source_of, table_rows, processors: int) -> float:  # type: ignore[no-untyped-def]
    """Samples per second of one processor (processor 0 of ``processors``)."""
    offsets = table_offsets(table_rows)
    source = source_of()
    t0 = time.perf_counter()
    samples = 0
    for number, batch, _ in source.numbered(2048, start=0, stride=processors):
        build_batch(number, batch, offsets)
        samples += len(batch)
    return samples / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lines", type=int, default=500_000)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        criteo, avazu = Path(tmp) / "day.tsv", Path(tmp) / "train.csv"
        criteo_file(criteo, a.lines)
        avazu_file(avazu, a.lines)
        for name, make, rows in (
            (
                "criteo",
                lambda: CriteoTSVSource(CriteoConfig((str(criteo),), KAGGLE_TABLE_ROWS)),
                KAGGLE_TABLE_ROWS,
            ),
            ("avazu", lambda: AvazuCSVSource(AvazuConfig((str(avazu),), AVAZU_TABLE_ROWS)), AVAZU_TABLE_ROWS),
        ):
            alone = measure(make, rows, 1)
            split = measure(make, rows, 2)
            print(
                f"{name}: {alone / 1e3:,.0f} k samples/s per processor alone; as one of 2 processors "
                f"{split / 1e3:,.0f} k samples/s of its own batches ({a.lines:,} lines, batch 2048)"
            )


if __name__ == "__main__":
    main()
