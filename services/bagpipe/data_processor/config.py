"""Command-line configuration of a data processor and the data source it reads."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from bagpipe.config_args import (
    Coordination,
    add_coordination_args,
    add_table_args,
    coordination_of,
    non_negative_int,
    parse_config,
    positive_int,
    table_argv,
    table_rows_of,
)
from bagpipe.core.data import SyntheticConfig, SyntheticSource
from bagpipe.data_processor.files import (
    DEFAULT_SHUFFLE_BUFFER,
    AvazuConfig,
    AvazuCSVSource,
    CriteoConfig,
    CriteoTSVSource,
    FileSource,
)


@dataclass(frozen=True)
class SourceConfig:
    """Which source to read and how.

    ``data`` is 'synthetic', 'criteo:PATH[,PATH...]' or 'avazu:PATH[,PATH...]'.
    """

    data: str
    table_rows: tuple[int, ...]
    seed: int = 0
    zipf_alpha: float | None = 1.1
    hot_fraction: float | None = None
    hot_share: float | None = None
    skip_bad_rows: bool = False
    shuffle_seed: int | None = None
    shuffle_buffer: int = DEFAULT_SHUFFLE_BUFFER

    def __post_init__(self) -> None:
        kind, _, paths = self.data.partition(":")
        if self.data != "synthetic" and not (kind in ("criteo", "avazu") and paths):
            raise ValueError(f"data: expected 'synthetic', 'criteo:PATH' or 'avazu:PATH', got {self.data!r}")
        if self.shuffle_seed is not None and self.data == "synthetic":
            raise ValueError(
                "shuffle_seed: synthetic samples are drawn at random already; it applies to files"
            )

    def check_head(self) -> None:
        """Parses the first chunk of every file as a batch would (``skip_bad_rows`` as set), and no more:
        raises the ``DataFormatError`` of a file whose first lines do not parse, naming file, line and
        field, before a job starts on it. Synthetic data has nothing to check."""
        source = self.open()
        if isinstance(source, FileSource):
            source.check_head()

    def open(self) -> SyntheticSource | FileSource:
        if self.data == "synthetic":
            hot = self.hot_fraction is not None or self.hot_share is not None
            return SyntheticSource(
                SyntheticConfig(
                    table_rows=self.table_rows,
                    seed=self.seed,
                    zipf_alpha=None if hot else self.zipf_alpha,
                    hot_fraction=self.hot_fraction,
                    hot_share=self.hot_share,
                )
            )
        kind, _, listed = self.data.partition(":")
        paths = tuple(p for p in listed.split(",") if p)
        config, source = (AvazuConfig, AvazuCSVSource) if kind == "avazu" else (CriteoConfig, CriteoTSVSource)
        return source(
            config(
                paths=paths,
                table_rows=self.table_rows,
                skip_bad_rows=self.skip_bad_rows,
                shuffle_seed=self.shuffle_seed,
                shuffle_buffer=self.shuffle_buffer,
            )
        )


@dataclass(frozen=True)
class DataProcessorConfig:
    """One data processor: its source, the global batch size and where to register."""

    source: SourceConfig
    batch_size: int
    index: int | None
    address: str = "127.0.0.1:0"
    coordination: Coordination = Coordination()

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"batch_size: must be >= 1, got {self.batch_size}")


def add_source_args(p: argparse.ArgumentParser) -> None:
    add_table_args(p)
    g = p.add_argument_group("synthetic skew and input checking")
    g.add_argument("--zipf-alpha", type=float, default=1.1, help="synthetic: Zipf exponent of row popularity")
    g.add_argument("--hot-fraction", type=float, default=None, help="synthetic: the top p of rows (0-1) ...")
    g.add_argument("--hot-share", type=float, default=None, help="... get this share (0-1) of the accesses")
    g.add_argument("--skip-bad-rows", action="store_true", help="files: count and skip malformed lines")
    g.add_argument(
        "--shuffle-seed",
        type=non_negative_int,
        default=None,
        help="files: shuffle samples within windows of --shuffle-buffer by this seed (default: file "
        "order); the batches do not depend on the number of processors, trainers or servers",
    )
    g.add_argument(
        "--shuffle-buffer",
        type=positive_int,
        default=DEFAULT_SHUFFLE_BUFFER,
        help=f"samples permuted together (default {DEFAULT_SHUFFLE_BUFFER})",
    )


def source_argv(s: SourceConfig) -> list[str]:
    """The flags ``add_source_args`` (and ``--seed``) parse back to ``s``."""
    out = table_argv(s.data, s.table_rows) + ["--seed", str(s.seed)]
    for flag, value in (
        ("--zipf-alpha", s.zipf_alpha),
        ("--hot-fraction", s.hot_fraction),
        ("--hot-share", s.hot_share),
        ("--shuffle-seed", s.shuffle_seed),
    ):
        out += [flag, repr(value)] if value is not None else []
    out += ["--shuffle-buffer", str(s.shuffle_buffer)]
    return out + (["--skip-bad-rows"] if s.skip_bad_rows else [])


def source_of(a: argparse.Namespace) -> SourceConfig:
    return SourceConfig(
        data=a.data,
        table_rows=table_rows_of(a),
        seed=a.seed,
        zipf_alpha=a.zipf_alpha,
        hot_fraction=a.hot_fraction,
        hot_share=a.hot_share,
        skip_bad_rows=a.skip_bad_rows,
        shuffle_seed=a.shuffle_seed,
        shuffle_buffer=a.shuffle_buffer,
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bagpipe-data-processor", description=DataProcessorConfig.__doc__)
    p.add_argument(
        "--index",
        type=int,
        default=None,
        help="this processor's index, its Redis member name (default: the host name)",
    )
    p.add_argument("--batch-size", type=int, required=True, help="global batch size")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic data")
    p.add_argument("--address", default="127.0.0.1:0", help="host:port to listen on (port 0: any)")
    add_source_args(p)
    add_coordination_args(p)
    return p


def parse(argv: list[str] | None = None) -> DataProcessorConfig:
    return parse_config(build_parser(), argv, _config)


def _config(a: argparse.Namespace) -> DataProcessorConfig:
    return DataProcessorConfig(
        source=source_of(a),
        batch_size=a.batch_size,
        index=a.index,
        address=a.address,
        coordination=coordination_of(a),
    )


def argv(c: DataProcessorConfig) -> list[str]:
    """The command line ``parse`` reads back to ``c`` (the launcher starts data processors with it)."""
    out = ["--batch-size", str(c.batch_size), "--address", c.address]
    out += ["--index", str(c.index)] if c.index is not None else []
    return out + source_argv(c.source) + c.coordination.argv()
