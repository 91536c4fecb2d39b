"""The documentation stays true to the code: the README's flag table is `bagpipe run`'s parser, every
relative link lands on a file (and heading) of this repository, and the front pages stay short."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest
from bagpipe.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
BENCH_README = ROOT / "bench" / "README.md"
PAGES = [README, BENCH_README, *sorted((ROOT / "docs").glob("*.md"))]
FLAG_TABLE_HEADING = "## `bagpipe run` flags"

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
INLINE_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
REFERENCE_LINK = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*(\S+)", re.M)
AUTOLINK = re.compile(r"<([a-z][a-z0-9+.-]*:[^>\s]+)>", re.I)
FLAG = re.compile(r"--[a-z0-9][a-z0-9-]*")


def _prose(path: Path) -> str:
    """The page without its fenced code blocks, where brackets and parentheses are code, not links."""
    return FENCE.sub("", path.read_text(encoding="utf-8"))


def _run_parser() -> argparse.ArgumentParser:
    parser = build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices["run"]
    raise AssertionError("bagpipe's parser has no `run` subcommand")


def _run_flags() -> dict[str, set[str]]:
    """Each documented-to-be flag of `bagpipe run` (its first long option) with all its long options;
    -h/--help and suppressed flags left out."""
    flags = {}
    for action in _run_parser()._actions:
        if isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS:
            continue
        longs = [o for o in action.option_strings if o.startswith("--")]
        if longs:
            flags[longs[0]] = set(longs)
    return flags


def _flag_table_flags() -> set[str]:
    """The flags named in the first column of the README's `bagpipe run` flag table."""
    text = README.read_text(encoding="utf-8")
    assert FLAG_TABLE_HEADING in text, f"README.md has no section {FLAG_TABLE_HEADING!r}"
    section = text.split(FLAG_TABLE_HEADING, 1)[1].split("\n## ", 1)[0]
    named = set()
    for line in section.splitlines():
        if line.startswith("|"):
            named.update(FLAG.findall(line.split("|")[1]))
    return named


def test_every_bagpipe_run_flag_is_in_the_readme_flag_table() -> None:
    documented = _flag_table_flags()
    missing = sorted(name for name, longs in _run_flags().items() if not longs & documented)
    assert not missing, f"flags of `bagpipe run` missing from README.md's flag table: {missing}"


def test_every_flag_in_the_readme_flag_table_exists() -> None:
    existing = set().union(*_run_flags().values())
    stale = sorted(_flag_table_flags() - existing)
    assert not stale, f"README.md's flag table names flags `bagpipe run` does not have: {stale}"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    for line in _prose(path).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = _slug(m.group(1))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def _links(path: Path) -> list[str]:
    text = _prose(path)
    return INLINE_LINK.findall(text) + REFERENCE_LINK.findall(text) + AUTOLINK.findall(text)


def _broken(page: Path, link: str) -> str | None:
    """Why ``link`` on ``page`` does not land inside the repository, or None."""
    if re.match(r"^([a-z][a-z0-9+.-]*:|//)", link, re.I):
        return "points outside the repository"
    target, _, anchor = link.partition("#")
    path = (page.parent / target).resolve() if target else page
    if not path.is_relative_to(ROOT) or "shared" in path.relative_to(ROOT).parts[:1]:
        return "points outside the repository"
    if not path.exists():
        return "no such file"
    if anchor and path.suffix == ".md" and anchor not in _anchors(path):
        return f"no heading #{anchor} in {path.relative_to(ROOT)}"
    return None


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_lands_inside_the_repository(page: Path) -> None:
    broken = [f"{link}: {why}" for link in _links(page) if (why := _broken(page, link))]
    assert not broken, f"{page.relative_to(ROOT)}: {broken}"


def test_the_docs_pages_exist() -> None:
    for name in ("architecture", "kubernetes", "data", "models", "benchmarks"):
        assert (ROOT / "docs" / f"{name}.md").is_file(), f"docs/{name}.md is missing"


@pytest.mark.parametrize(("page", "most"), [(README, 450), (BENCH_README, 300)], ids=["README", "bench"])
def test_front_pages_stay_short(page: Path, most: int) -> None:
    lines = len(page.read_text(encoding="utf-8").splitlines())
    assert lines <= most, f"{page.relative_to(ROOT)} has {lines} lines; at most {most}"
