"""The sections of ``bench/harness.py``, one module each, named as the section.

``NAMES`` is the order they run in (``--only`` and a profile's ``sections`` pick some, and the order). A
section's module has

* ``run(profile, out) -> dict``, which measures; what it returns is the section's entry in
  ``bench-<profile>.json``, kept there until the section runs again;

and, where it adds to the report, any of these, each given every section's figures (this run's, or a
section's last where it did not run) and answering with nothing where its figures are absent:

* ``table(results) -> list[str]``: its lines of the tables (``bench-<profile>.md``, and printed);
* ``targets(results) -> tuple[list[Target], list[str]]``: its targets against its figures
  (``suite.report.Target``), and notes printed after every section's targets;
* ``plots(results, out, profile) -> list[str]``: the plots it writes into ``out``, by file name.

``suite.report`` puts the report together, in its own order for the sections there before it and in
``NAMES``' order after them for the others.
"""

from __future__ import annotations

import importlib
from types import ModuleType

NAMES = (
    "systems",
    "models",
    "torchrec",
    "network",
    "oracle",
    "embedding_server",
    "lookahead",
    "skew",
    "tier",
)
SECTIONS: dict[str, ModuleType] = {name: importlib.import_module(f"{__name__}.{name}") for name in NAMES}
