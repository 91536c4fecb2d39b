"""The report: the sections' tables, targets and plots, put together in one order.

Each section adds its own parts (``table``, ``targets``, ``plots``: see ``bench/sections``); this module
orders them and formats the targets. The comparisons' tables come first and the oracle's last, and the
limited links' targets first, as the report has always read; a section not named in these orders adds
its parts after them, in the order the sections run.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import matplotlib

# a target: what it is, the figure, the target as text (">= 2.5"), and whether the figure meets it
Target = tuple[str, float, str, bool]

TABLE_ORDER = ("systems", "models", "torchrec", "network", "lookahead", "skew", "oracle")
TARGET_ORDER = ("network", "torchrec", "skew", "oracle", "embedding_server")


def pyplot() -> ModuleType:
    """matplotlib's pyplot, drawing into files (the Agg backend: no display), for the sections' plots."""
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def ordered(sections: Mapping[str, ModuleType], first: Iterable[str], hook: str) -> list[Any]:
    """The sections' ``hook`` functions: those of the sections in ``first`` in that order, then the rest
    in the sections' order; sections without the hook are left out."""
    names = [n for n in first if n in sections] + [n for n in sections if n not in first]
    return [getattr(sections[n], hook) for n in names if hasattr(sections[n], hook)]


def table(results: dict[str, Any], sections: Mapping[str, ModuleType]) -> str:
    """The tables of every section with figures in ``results``, as Markdown."""
    return "\n".join(line for part in ordered(sections, TABLE_ORDER, "table") for line in part(results))


def targets(results: dict[str, Any], sections: Mapping[str, ModuleType]) -> list[str]:
    """Issue 17's targets against the figures at hand (sections not run this time: their last figures),
    one line each, then the notes beside them."""
    rows: list[Target] = []
    notes: list[str] = []  # printed after the rows: figures that are not themselves a target
    for part in ordered(sections, TARGET_ORDER, "targets"):
        more_rows, more_notes = part(results)
        rows += more_rows
        notes += more_notes
    return [
        f"{name:48s} {value:7.3f}  target {want:8s} {'met' if ok else 'NOT met'}"
        for name, value, want, ok in rows
    ] + notes


def plots(results: dict[str, Any], out: Path, profile: str, sections: Mapping[str, ModuleType]) -> list[str]:
    """Every section's plots, written into ``out``; their file names."""
    return [made for part in ordered(sections, TABLE_ORDER, "plots") for made in part(results, out, profile)]
