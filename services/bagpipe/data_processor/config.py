"""A data processor's configuration and the data source it reads: each field its flag (``bagpipe.flags``)."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

from bagpipe import flags
from bagpipe.config_args import (
    Coordination,
    command_line,
    data_field,
    non_negative_int,
    positive_int,
    schema_field,
    table_rows_field,
)
from bagpipe.core.data import SyntheticConfig, SyntheticSource
from bagpipe.core.schema import TABLE_KINDS, Schema, schema_of
from bagpipe.data_processor.files import (
    DEFAULT_SHUFFLE_BUFFER,
    AvazuConfig,
    AvazuCSVSource,
    CriteoConfig,
    CriteoTSVSource,
    FileConfig,
    FileSource,
)
from bagpipe.flags import flag

FILE_KINDS = ("criteo", "avazu", *TABLE_KINDS)


@dataclass(frozen=True)
class SourceConfig:
    """Which source to read and how.

    ``data`` is 'synthetic', 'criteo:PATH[,PATH...]', 'avazu:PATH[,PATH...]', or 'csv:', 'tsv:' or
    'parquet:PATH[,PATH...]' laid out as ``schema`` says (``core/schema.py``).
    """

    data: str = data_field(positional=True)
    table_rows: tuple[int, ...] = table_rows_field()
    seed: int = flag("seed of the synthetic data", default=0, parse=int)
    zipf_alpha: float | None = flag("synthetic: Zipf exponent of row popularity", default=1.1, parse=float)
    hot_fraction: float | None = flag("synthetic: the top p of rows (0-1) ...", default=None, parse=float)
    hot_share: float | None = flag("... get this share (0-1) of the accesses", default=None, parse=float)
    skip_bad_rows: bool = flag("files: count and skip malformed lines", default=False)
    shuffle_seed: int | None = flag(
        "files: shuffle samples within windows of --shuffle-buffer by this seed (default: file order); the "
        "batches do not depend on the number of processors, trainers or servers",
        default=None,
        parse=non_negative_int,
    )
    shuffle_buffer: int = flag(
        "samples permuted together", default=DEFAULT_SHUFFLE_BUFFER, parse=positive_int
    )
    schema: str | None = schema_field()

    def __post_init__(self) -> None:
        kind, _, paths = self.data.partition(":")
        if self.data != "synthetic" and not (kind in FILE_KINDS and paths):
            raise ValueError(
                "data: expected 'synthetic', 'criteo:PATH', 'avazu:PATH', 'csv:PATH', 'tsv:PATH' or "
                f"'parquet:PATH', got {self.data!r}"
            )
        if self.schema is not None and kind not in TABLE_KINDS:
            raise ValueError(f"schema: applies to csv:, tsv: and parquet: data, not {kind}")
        if self.shuffle_seed is not None and self.data == "synthetic":
            raise ValueError(
                "shuffle_seed: synthetic samples are drawn at random already; it applies to files"
            )
        if self.data == "synthetic":
            self.synthetic()  # (its rules: the Zipf exponent, the hot set's fraction and share)

    def synthetic(self) -> SyntheticConfig:
        hot = self.hot_fraction is not None or self.hot_share is not None
        return SyntheticConfig(
            table_rows=self.table_rows,
            seed=self.seed,
            zipf_alpha=None if hot else self.zipf_alpha,
            hot_fraction=self.hot_fraction,
            hot_share=self.hot_share,
        )

    def check_head(self) -> None:
        """Parses the first chunk of every file as a batch would (``skip_bad_rows`` as set), and no more:
        raises the ``DataFormatError`` of a file whose first lines do not parse, naming file, line and
        field, before a job starts on it. Synthetic data has nothing to check."""
        source = self.open()
        if isinstance(source, FileSource):
            source.check_head()

    def open(self, layout: Schema | None = None) -> SyntheticSource | FileSource:
        """The source; csv:, tsv: and parquet: data laid out as ``layout`` where given (else ``layout()``)."""
        if self.data == "synthetic":
            return SyntheticSource(self.synthetic())
        kind, _, listed = self.data.partition(":")
        config = {"avazu": AvazuConfig, "criteo": CriteoConfig}.get(kind, FileConfig)
        files = config(
            paths=tuple(p for p in listed.split(",") if p),
            table_rows=self.table_rows,
            skip_bad_rows=self.skip_bad_rows,
            shuffle_seed=self.shuffle_seed,
            shuffle_buffer=self.shuffle_buffer,
        )
        if kind in TABLE_KINDS:
            from bagpipe.data_processor.tables import TableSource  # (pyarrow: only where such data is read)

            return TableSource(files, layout or self.layout(), kind)
        return AvazuCSVSource(files) if kind == "avazu" else CriteoTSVSource(files)  # (their own parsers)

    def layout(self) -> Schema:
        """The data's schema, with its tables' sizes (``table_rows``)."""
        return schema_of(self.data, self.schema).with_table_rows(self.table_rows)


@dataclass(frozen=True)
class DataProcessorConfig:
    """One data processor: its source, the global batch size and where to register."""

    source: SourceConfig
    batch_size: int = flag("global batch size", parse=int)
    index: int | None = flag(
        "this processor's index, its Redis member name (default: the host name)", parse=int, required=False
    )
    address: str = flag("host:port to listen on (port 0: any)", default="127.0.0.1:0")
    coordination: Coordination = Coordination()

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"batch_size: must be >= 1, got {self.batch_size}")


def add_source_args(p: argparse.ArgumentParser) -> None:
    """The source's flags but ``--seed`` (``bagpipe run`` has one seed for everything)."""
    fields = [f.name for f in dataclasses.fields(SourceConfig) if f.name != "seed"]
    flags.add_flags(p.add_argument_group("data and input checking"), SourceConfig, only=fields)


def source_of(a: argparse.Namespace) -> SourceConfig:
    return flags.config_of(SourceConfig, a)


# the service's command line: ``python -m`` parses it, ``bagpipe run`` and the chart write it
build_parser, parse, argv = command_line(DataProcessorConfig, "bagpipe-data-processor")
