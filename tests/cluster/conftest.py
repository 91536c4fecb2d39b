"""The cluster tests' figures, printed at the end of the run (``make cluster-test``)."""

from __future__ import annotations

from typing import Any

FIGURES: list[str] = []


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if FIGURES:
        terminalreporter.section("the chart's pods under podman")
        for line in FIGURES:
            terminalreporter.write_line(line)
