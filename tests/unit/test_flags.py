"""``bagpipe.flags``: a config dataclass declares its flags once; parser, config and argv come from it."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from bagpipe import flags
from bagpipe.flags import flag


@dataclass(frozen=True)
class Inner:
    url: str = flag("where", default="redis://x", name="redis")
    level: str = flag("logging level", default="INFO")


@dataclass(frozen=True)
class Example:
    """A config of every kind of flag."""

    workers: int = flag("how many")
    inner: Inner = Inner()
    rate: float = flag("per second", default=1.5, show=lambda v: f"{v:g}")
    name: str | None = flag("optional", default=None)
    mode: str = flag("one of", default="a", choices=("a", "b"))
    fast: bool = flag("a switch", default=False)
    tags: tuple[str, ...] = flag("repeatable", default=())
    sizes: tuple[int, ...] = flag("repeatable numbers", default=())

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"workers: must be >= 1, got {self.workers}")


def _parse(args: list[str]) -> Example:
    return flags.parse(Example, flags.parser(Example, "example", "test"), args)


def test_argv_gives_the_config_back() -> None:
    config = Example(
        workers=3,
        inner=Inner(url="redis://y", level="DEBUG"),
        rate=0.25,
        name="n",
        mode="b",
        fast=True,
        tags=("p", "q"),
        sizes=(4, 5),
    )
    argv = flags.argv(config)
    assert argv[:2] == ["--workers", "3"] and "--redis" in argv and "--fast" in argv
    assert _parse(argv) == config
    # defaults are left out, and come back as defaults
    assert flags.argv(Example(workers=2)) == ["--workers", "2"]
    assert _parse(["--workers", "2"]) == Example(workers=2)


def test_a_missing_flag_a_bad_choice_and_a_refused_value_name_the_flag(capsys) -> None:
    with pytest.raises(SystemExit):
        _parse([])
    assert "--workers" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _parse(["--workers", "1", "--mode", "c"])
    assert "--mode" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _parse(["--workers", "0"])
    assert "--workers: must be >= 1, got 0" in capsys.readouterr().err


def test_help_comes_from_the_declarations() -> None:
    text = flags.parser(Example, "example", "test").format_help()
    for words in ("how many", "per second (default 1.5)", "--redis", "repeatable numbers", "--no-fast"):
        assert words in text
