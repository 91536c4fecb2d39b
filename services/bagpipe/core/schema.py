"""The input's schema: which column is the label, which are dense features, which are categorical and how
many rows each one's table has, and how a value becomes a row (``Schema``).

A schema file is YAML or JSON::

    format: parquet            # csv, tsv or parquet (the --data kind may say it instead)
    header: true               # csv/tsv: the first line names the columns (default true)
    columns:
      - {name: clicked, role: label}
      - {name: price, role: dense}                 # transform: log1p (default) or none
      - {name: country, role: categorical, rows: 300}  # hashing: hash (default), mod or none
      - {name: session, role: ignore}

``role`` is ``label`` (exactly one; 0 or 1), ``dense`` (a number; ``log1p``: log(1 + max(x, 0)), as
Criteo's counts; ``none``: as it is; ``hour``: the hour of a YYMMDDHH time, as log(1 + HH), Avazu's),
``categorical`` (a table of ``rows`` rows; ``hash``: FNV-1a-64 of
the value's text, modulo rows; ``mod``: an integer modulo rows; ``none``: an integer that is the row,
checked; ``hex``: hexadecimal text modulo rows, Criteo's) or ``ignore``. A missing dense value is 0 and a
missing categorical one row 0. ``column`` names the file's column an entry reads, where it is not its
``name`` (two entries may read one column: Avazu's hour is a table and a dense feature). ``rows`` may be
left out where ``--table-rows`` gives the tables' sizes.

The Criteo and Avazu layouts are two such schemas shipped with the package (``bagpipe/schemas``): the
``criteo:`` and ``avazu:`` sources, and synthetic data (Criteo's), follow them. A schema may also be
inferred from a file (:meth:`Schema.infer`): a column named label, click, clicked or target is the label,
floating-point columns are dense (``log1p`` where their first values are all >= 0, as counts are; else
``none``), the others categorical; :meth:`Schema.describe` says in one line what it inferred.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

ROLES = ("label", "dense", "categorical", "ignore")
HASHINGS = ("hash", "mod", "none", "hex")
TRANSFORMS = ("log1p", "none", "hour")
FORMATS = ("csv", "tsv", "parquet")
BUILT_IN = ("criteo", "avazu")
LABEL_NAMES = ("label", "click", "clicked", "target")
# --data kinds whose layout a schema gives (criteo: and avazu: have their own; synthetic is Criteo's)
TABLE_KINDS = FORMATS


class SchemaError(ValueError):
    """A schema that cannot be used: where (file, column) and why. Its text starts with ``schema:``, so a
    config's error names the flag."""


@dataclass(frozen=True)
class Column:
    name: str
    role: str
    rows: int | None = None  # categorical: its table's rows
    hashing: str = "hash"  # categorical: how a value becomes a row
    transform: str = "log1p"  # dense: what is applied to the value
    column: str | None = None  # the file's column it reads (default: its name; two may read one)

    @property
    def reads(self) -> str:
        return self.column or self.name


@dataclass(frozen=True)
class Schema:
    """The columns of the input, in file order (Parquet: by name)."""

    columns: tuple[Column, ...]
    format: str | None = None  # csv, tsv or parquet (None: the --data kind's)
    header: bool = True
    source: str = "schema"  # where it was read, for errors

    def __post_init__(self) -> None:
        where = self.source
        if self.format is not None and self.format not in FORMATS:
            raise SchemaError(f"schema: {where}: format: {self.format!r} is not one of {', '.join(FORMATS)}")
        names = [c.name for c in self.columns]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise SchemaError(f"schema: {where}: columns: {', '.join(twice)} named twice")
        for i, c in enumerate(self.columns):
            at = f"schema: {where}: columns[{i}] ({c.name})"
            if not c.name:
                raise SchemaError(f"schema: {where}: columns[{i}]: needs a name")
            if c.role not in ROLES:
                raise SchemaError(f"{at}: role: {c.role!r} is not one of {', '.join(ROLES)}")
            if c.hashing not in HASHINGS:
                raise SchemaError(f"{at}: hashing: {c.hashing!r} is not one of {', '.join(HASHINGS)}")
            if c.transform not in TRANSFORMS:
                raise SchemaError(f"{at}: transform: {c.transform!r} is not one of {', '.join(TRANSFORMS)}")
            if c.rows is not None and (not isinstance(c.rows, int) or isinstance(c.rows, bool) or c.rows < 1):
                raise SchemaError(f"{at}: rows: must be an integer >= 1, got {c.rows!r}")
        labels = [c.name for c in self.columns if c.role == "label"]
        if len(labels) != 1:
            raise SchemaError(f"schema: {where}: needs exactly one label column, got {labels or 'none'}")
        if not self.categorical:
            raise SchemaError(f"schema: {where}: needs at least one categorical column")

    @property
    def label(self) -> Column:
        return next(c for c in self.columns if c.role == "label")

    @property
    def dense(self) -> tuple[Column, ...]:
        return tuple(c for c in self.columns if c.role == "dense")

    @property
    def categorical(self) -> tuple[Column, ...]:
        return tuple(c for c in self.columns if c.role == "categorical")

    @property
    def num_dense(self) -> int:
        return len(self.dense)

    @property
    def num_tables(self) -> int:
        return len(self.categorical)

    @property
    def table_rows(self) -> tuple[int, ...] | None:
        """Each categorical column's rows, or None where one has none."""
        rows = [c.rows for c in self.categorical]
        return None if None in rows else tuple(int(r) for r in rows if r is not None)

    def with_table_rows(self, table_rows: tuple[int, ...]) -> Schema:
        """The schema with its tables' sizes set (``--table-rows``), one per categorical column."""
        if len(table_rows) != self.num_tables:
            raise ValueError(
                f"table_rows: expected {self.num_tables} values (the schema's categorical columns), got "
                f"{len(table_rows)}"
            )
        sizes = iter(table_rows)
        columns = tuple(
            dataclasses.replace(c, rows=int(next(sizes))) if c.role == "categorical" else c
            for c in self.columns
        )
        return dataclasses.replace(self, columns=columns)

    # -- reading
    @classmethod
    def of(cls, spec: dict[str, Any], source: str) -> Schema:
        """A schema from its parsed file (``source``: where it was read)."""
        if not isinstance(spec, dict) or not isinstance(spec.get("columns"), list):
            raise SchemaError(f"schema: {source}: expected a mapping with a list 'columns'")
        unknown = sorted(set(spec) - {"format", "header", "columns"})
        if unknown:
            raise SchemaError(f"schema: {source}: unknown key(s) {', '.join(unknown)}")
        columns = []
        fields = {f.name for f in dataclasses.fields(Column)}
        for i, entry in enumerate(spec["columns"]):
            if not isinstance(entry, dict):
                raise SchemaError(f"schema: {source}: columns[{i}]: expected a mapping, got {entry!r}")
            extra = sorted(set(entry) - fields)
            if extra:
                raise SchemaError(f"schema: {source}: columns[{i}]: unknown key(s) {', '.join(extra)}")
            if "name" not in entry or "role" not in entry:
                raise SchemaError(f"schema: {source}: columns[{i}]: needs 'name' and 'role'")
            columns.append(Column(**{k: v for k, v in entry.items()}))
        header = spec.get("header", True)
        if not isinstance(header, bool):
            raise SchemaError(f"schema: {source}: header: expected true or false, got {header!r}")
        return cls(tuple(columns), spec.get("format"), header, source)

    @classmethod
    def load(cls, path: str) -> Schema:
        """A schema file (``.json``, else YAML), or a built-in layout's name (``criteo``, ``avazu``)."""
        if path in BUILT_IN:
            return built_in(path)
        p = Path(path)
        if not p.is_file():
            raise SchemaError(f"schema: {path}: no such file")
        text = p.read_text(encoding="utf-8")
        language = "JSON" if p.suffix == ".json" else "YAML"
        try:
            if language == "JSON":
                spec = json.loads(text)
            else:
                import yaml

                spec = yaml.safe_load(text)
        except Exception as e:  # (json.JSONDecodeError, yaml.YAMLError: the parser's line and column)
            raise SchemaError(f"schema: {path}: not valid {language}: {e}") from None
        return cls.of(spec, path)

    def to_dict(self) -> dict[str, Any]:
        columns = []
        for c in self.columns:
            entry: dict[str, Any] = {"name": c.name, "role": c.role}
            if c.role == "categorical":
                entry.update({"rows": c.rows, "hashing": c.hashing})
            elif c.role == "dense":
                entry["transform"] = c.transform
            columns.append(entry)
        return {"format": self.format, "header": self.header, "columns": columns}

    @classmethod
    def infer(cls, kind: str, path: str) -> Schema:
        """The schema of a ``kind`` (csv, tsv, parquet) file from its header (or Parquet's own schema) and
        the types of its first rows; the tables' sizes are left to ``--table-rows``. A dense column whose
        first values (CSV and TSV: the first MiB's rows, which the types come from too; Parquet: its
        statistics, or its first row group) are all >= 0 is taken for a count and gets ``log1p``: raw,
        counts in the tens of thousands make the model diverge at once. One with a negative value gets
        ``none``."""
        pa = _pyarrow(kind)
        if kind == "parquet":
            import pyarrow.parquet as pq

            types = {f.name: f.type for f in pq.read_schema(path)}
        else:
            from pyarrow import csv

            reader = csv.open_csv(
                path,
                read_options=csv.ReadOptions(block_size=1 << 20),
                parse_options=csv.ParseOptions(delimiter="\t" if kind == "tsv" else ","),
            )
            types = {f.name: f.type for f in reader.schema}
            try:
                first = reader.read_next_batch()
            except StopIteration:  # (a header alone: nothing says a column is a count)
                first = None
            reader.close()
        labels = [n for n in types if n.lower() in LABEL_NAMES]
        if not labels:
            raise SchemaError(
                f"schema: {path}: no label column to infer (a column named {', '.join(LABEL_NAMES)}); "
                "give a schema file with --schema"
            )
        dense = [n for n, t in types.items() if n != labels[0] and pa.types.is_floating(t)]
        if kind == "parquet":
            lowest = _parquet_minima(path, dense)
        else:
            lowest = {n: _minimum(first.column(n)) if first is not None else None for n in dense}
        columns = []
        for name, kind_ in types.items():
            if name == labels[0]:
                columns.append(Column(name, "label"))
            elif name in lowest:
                low = lowest[name]
                columns.append(
                    Column(name, "dense", transform="none" if low is not None and low < 0 else "log1p")
                )
            else:
                columns.append(
                    Column(name, "categorical", hashing="mod" if pa.types.is_integer(kind_) else "hash")
                )
        return cls(tuple(columns), kind, True, f"{path} (inferred)")

    def describe(self) -> str:
        """The columns' roles in one line (what an inferred schema took each column for)."""
        groups: dict[str, list[str]] = {}
        for c in self.columns:
            how = {"dense": c.transform, "categorical": c.hashing}.get(c.role)
            groups.setdefault(f"{c.role} ({how})" if how else c.role, []).append(c.name)
        return "; ".join(f"{what}: {', '.join(names)}" for what, names in groups.items())


def _minimum(column: Any) -> float | None:
    """The least value of a pyarrow column (None: every value missing)."""
    import pyarrow.compute as pc

    low = pc.min(column).as_py()
    return None if low is None else float(low)


def _parquet_minima(path: str, names: list[str]) -> dict[str, float | None]:
    """Each column's least value from the file's row-group statistics where every row group has them, else
    from its first row group."""
    import pyarrow.parquet as pq

    file = pq.ParquetFile(path)
    meta = file.metadata
    position = {meta.schema.column(i).path: i for i in range(meta.num_columns)}
    out: dict[str, float | None] = {}
    for name in names:
        groups = [meta.row_group(g).column(position[name]).statistics for g in range(meta.num_row_groups)]
        if all(stats is not None and stats.has_min_max for stats in groups):
            out[name] = min((float(stats.min) for stats in groups), default=None)
        else:
            out[name] = _minimum(file.read_row_group(0, columns=[name]).column(name))
    return out


def _pyarrow(kind: str) -> Any:
    try:
        import pyarrow
    except ImportError:
        raise SchemaError(
            f"schema: {kind}: data needs the pyarrow package (pip install 'bagpipe[parquet]', or pyarrow)"
        ) from None
    return pyarrow


@functools.cache
def built_in(name: str) -> Schema:
    """The schema shipped with the package for ``name`` (criteo, avazu)."""
    text = resources.files("bagpipe.schemas").joinpath(f"{name}.json").read_text(encoding="utf-8")
    return Schema.of(json.loads(text), f"{name} (built in)")


def schema_of(data: str, schema: str | None = None) -> Schema:
    """The schema of a ``--data`` source: criteo: and synthetic data are Criteo's layout, avazu: Avazu's;
    csv:, tsv: and parquet: files follow ``schema`` (a file, or a built-in name), or one inferred from
    their first file."""
    kind, _, listed = data.partition(":")
    if kind in ("synthetic", "criteo"):
        return built_in("criteo")
    if kind == "avazu":
        return built_in("avazu")
    if kind in TABLE_KINDS:
        if schema:
            found = Schema.load(schema)
            if found.format is not None and found.format != kind:
                raise SchemaError(f"schema: {schema}: is for {found.format} files, the data is {kind}:")
            return found
        first = next((p for p in listed.split(",") if p), "")
        if not Path(first).is_file():
            raise SchemaError(
                f"schema: none given, and {kind}: data's first file {first!r} is not there to infer one"
            )
        return Schema.infer(kind, first)
    raise ValueError(
        f"data: expected 'synthetic', 'criteo:PATH', 'avazu:PATH', 'csv:PATH', 'tsv:PATH' or 'parquet:PATH', "
        f"got {data!r}"
    )
