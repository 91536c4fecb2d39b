"""values.yaml documents every value once, bitnami's way (a ``## @param <dotted.key> <description>`` line,
what readme-generator-for-helm turns into the values table), and every flag the chart hands a container is
one that the container's own parser declares, spelled out in full."""

from __future__ import annotations

import argparse
import importlib
import re
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from tests.chart.test_chart import CHART, CI_VALUES, PARSERS, pod_specs, render

VALUES = CHART / "values.yaml"
# `## @param key description` documents key; `## @skip key` leaves it (and what it holds) out of the table
DOC_LINE = re.compile(r"^\s*## @(param|skip) (\S+)", re.MULTILINE)
# Kubernetes fields the chart passes through as they are: one @param documents whatever they hold
PASS_THROUGH = {
    "resources",
    "nodeSelector",
    "tolerations",
    "affinity",
    "extraEnv",
    "podAnnotations",
    "labels",
    "annotations",
    "podLabels",
    "extraFrom",
    "volume",
}
# every container whose args the chart writes, and the module whose build_parser() reads them
CONTAINER_PARSERS = {**PARSERS, "check-model": "bagpipe.check_model"}
NOT_OURS = {"redis", "probe"}  # redis-server's flags; the test pod's probe takes only URLs
# values that turn on every flag the chart writes only when asked (a DCN, eps, a seeded shuffle, a fixed L,
# a bounded cache, evaluation, a starting model, a row tier)
EVERY_OPTIONAL_FLAG = [
    *("--set", "training.model=dcn", "--set", "training.deepMlp={64,32}", "--set", "training.crossLayers=2"),
    *("--set-json", "training.eps=1e-8", "--set", "training.shuffleSeed=7", "--set", "training.lookahead=50"),
    *("--set", "training.cacheRows=100000", "--set", "training.initFrom=run-0/final.pt"),
    *("--set", "training.eval.data=synthetic", "--set", "training.eval.every=100"),
    *("--set", "embeddingServer.rowMemory=1Gi"),
]


def documented() -> Counter[str]:
    """How many @param/@skip lines name each key."""
    return Counter(m.group(2) for m in DOC_LINE.finditer(VALUES.read_text()))


def key_paths(values: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, bool]]:
    """Every key's dotted path, and whether it is a leaf: lists and empty dicts are values, like scalars."""
    for key, value in values.items():
        path = f"{prefix}{key}"
        inner = isinstance(value, dict) and bool(value)
        yield path, not inner
        if inner:
            yield from key_paths(value, f"{path}.")


def prefixes(path: str) -> list[str]:
    """``a.b.c`` -> ``a``, ``a.b``, ``a.b.c``: the key and every key that holds it."""
    parts = path.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


def test_every_value_has_exactly_one_param_line() -> None:
    docs = documented()
    values = yaml.safe_load(VALUES.read_text())
    counts = {path: sum(docs[p] for p in prefixes(path)) for path, leaf in key_paths(values) if leaf}
    assert not [path for path, n in counts.items() if n == 0], "values without a ## @param line"
    assert not [path for path, n in counts.items() if n > 1], "values documented more than once"


def test_every_param_line_names_a_value() -> None:
    paths = {path for path, _ in key_paths(yaml.safe_load(VALUES.read_text()))}
    assert not sorted(set(documented()) - paths), "## @param lines for keys values.yaml does not have"


def test_only_pass_through_fields_are_documented_whole() -> None:
    """A @param on a key that holds others documents them all, which only a Kubernetes field passed through
    as it is may do: a section (``training``) documents each of its values."""
    inner = {path for path, leaf in key_paths(yaml.safe_load(VALUES.read_text())) if not leaf}
    whole = sorted(p for p in documented() if p in inner and p.rsplit(".", 1)[-1] not in PASS_THROUGH)
    assert not whole, "document each value these hold"


def test_sections_group_the_params() -> None:
    tags = re.findall(r"^\s*## @(section|param) ", VALUES.read_text(), re.MULTILINE)
    assert tags[0] == "section", "a ## @section line before the first ## @param"


def option_strings(parser: argparse.ArgumentParser) -> set[str]:
    return {s for action in parser._actions for s in action.option_strings}


def rendered_flags(args: list[str]) -> dict[str, set[str]]:
    """Every ``--flag`` in every container's args (``--flag=value`` counts as ``--flag``), by container."""
    flags: dict[str, set[str]] = {}
    for pod in pod_specs(render(*args)).values():
        for c in [*pod.get("initContainers", []), *pod["containers"]]:
            found = {str(a).split("=", 1)[0] for a in c.get("args", []) if str(a).startswith("--")}
            flags.setdefault(c["name"], set()).update(found)
    return flags


@pytest.mark.parametrize(
    "args",
    [[], EVERY_OPTIONAL_FLAG, *(["-f", str(v)] for v in CI_VALUES)],
    ids=["default", "every-optional-flag", *(v.stem for v in CI_VALUES)],
)
def test_every_rendered_flag_is_declared_by_its_services_parser(args: list[str]) -> None:
    """The training values become flags; each must be an option its service declares, in full (argparse
    would also take an abbreviation, which a renamed flag could silently turn into)."""
    flags = rendered_flags(args)
    assert not sorted(set(flags) - set(CONTAINER_PARSERS) - NOT_OURS), "containers with no known parser"
    for name, found in flags.items():
        if name in NOT_OURS:
            continue
        declared = option_strings(importlib.import_module(CONTAINER_PARSERS[name]).build_parser())
        assert not sorted(found - declared), f"{name}: flags its parser does not declare"


def test_the_optional_flags_render_when_their_values_are_set() -> None:
    """The render above that is meant to reach every optional flag does reach them."""
    flags = rendered_flags(EVERY_OPTIONAL_FLAG)
    trainer = {"--eps", "--cache-rows", "--deep-mlp", "--cross-layers", "--init-from"}
    assert trainer | {"--eval-data", "--eval-every"} <= flags["trainer"]
    assert {"--shuffle-seed", "--shuffle-buffer"} <= flags["data-processor"]
    assert {"--eval-every", "--lookahead", "--cache-rows"} <= flags["oracle-cacher"]
