"""The benchmark's sections (bench/sections): each a module named as its section, run by
``bench/harness.py``, and the report put together from their parts, a section the report's orders do not
name adding its parts after the others'."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))
import harness  # noqa: E402
from sections import NAMES, SECTIONS  # noqa: E402
from suite import report  # noqa: E402


def test_every_section_is_a_module_named_as_it_that_runs() -> None:
    assert list(SECTIONS) == list(NAMES)
    for name, module in SECTIONS.items():
        assert module.__name__ == f"sections.{name}"
        assert Path(module.__file__).name == f"{name}.py"
        assert callable(module.run), f"sections/{name}.py has no run(profile, out)"


def test_the_entry_point_names_every_section_in_its_help(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "argv", ["harness.py", "--help"])
    with pytest.raises(SystemExit) as exit_:
        harness.main()
    assert exit_.value.code == 0
    said = " ".join(capsys.readouterr().out.split())
    assert f"comma-separated sections of {', '.join(NAMES)}" in said


def test_a_section_the_report_does_not_name_adds_its_parts_after_the_others(tmp_path: Path) -> None:
    def section(**hooks: object) -> SimpleNamespace:
        return SimpleNamespace(run=lambda profile, out: {}, **hooks)

    sections = {
        "tier": section(
            table=lambda results: ["tier table"],
            targets=lambda results: ([("tier figure", 2.0, ">= 1", True)], ["  (tier note)"]),
            plots=lambda results, out, profile: [f"tier-{profile}.png"],
        ),
        "oracle": section(
            table=lambda results: ["oracle table"],
            targets=lambda results: ([("oracle figure", 0.5, ">= 1", False)], ["  (oracle note)"]),
        ),
        "systems": section(table=lambda results: ["systems table", ""]),
        "network": section(targets=lambda results: ([("link figure", 1.0, "<= 1.05", True)], [])),
    }
    assert report.table({}, sections) == "systems table\n\noracle table\ntier table"
    assert report.targets({}, sections) == [
        f"{'link figure':48s}   1.000  target <= 1.05  met",
        f"{'oracle figure':48s}   0.500  target >= 1     NOT met",
        f"{'tier figure':48s}   2.000  target >= 1     met",
        "  (oracle note)",
        "  (tier note)",
    ]
    assert report.plots({}, tmp_path, "quick", sections) == ["tier-quick.png"]


def test_without_figures_the_sections_report_nothing(tmp_path: Path) -> None:
    assert report.table({}, SECTIONS) == ""
    assert report.targets({}, SECTIONS) == []
    assert report.plots({}, tmp_path, "quick", SECTIONS) == []
