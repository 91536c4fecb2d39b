"""``RunConfig``: every flag of ``bagpipe run`` once, as a field; built from Python or from the command
line alike, checked as it is built."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from bagpipe import ConfigError, RunConfig, cli
from bagpipe.flags import option


def _run_parser_options() -> set[str]:
    parser = cli.build_parser()
    run = next(a for a in parser._actions if a.dest == "command").choices["run"]
    return {o for a in run._actions for o in a.option_strings if o.startswith("--")}


def test_each_field_is_the_flag_of_its_name_and_each_flag_a_field() -> None:
    fields = {f.name: f for f in dataclasses.fields(RunConfig)}
    options = {option(f, f.metadata["bagpipe.flag"]) for f in fields.values()}
    assert {name.replace("_", "-") for name in fields} == {o[2:] for o in options}
    # the parser's options: the fields' (booleans also as --no-X), help and the TLS files (environment)
    booleans = {f"--no-{n.replace('_', '-')}" for n, f in fields.items() if f.type == "bool"}
    tls = {"--tls-cert", "--tls-key", "--tls-ca", "--tls-server-name"}
    assert _run_parser_options() == options | booleans | tls | {"--help"}


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["--model", "dcn", "--deep-mlp", "32,16", "--cross-layers", "2", "--trainers", "4"],
        ["--optimizer", "adam", "--lr", "0.01", "--eps", "1e-06", "--sync", "critical", "--no-report"],
        ["--table-rows", ",".join(["50"] * 26), "--lookahead", "7", "--cache-rows", "900", "--quiet"],
        ["--system", "no-cache", "--embedding-server-priority", "normal", "--migration-rows-per-second", "0"],
        ["--eval-data", "synthetic", "--eval-every", "10", "--hot-fraction", "0.1", "--hot-share", "0.9"],
    ],
)
def test_the_command_line_and_python_give_the_same_config(argv: list[str]) -> None:
    config = cli.parse_run(argv)
    assert cli.parse_run(config.argv()) == config
    as_keywords = {f.name: getattr(config, f.name) for f in dataclasses.fields(RunConfig)}
    assert RunConfig(**as_keywords) == config
    assert RunConfig.from_json(json.loads(json.dumps(config.to_json()))) == config


@pytest.mark.parametrize(
    ("keywords", "field", "flag", "why"),
    [
        ({"trainers": 0}, "trainers", "--trainers", "must be >= 1, got 0"),
        ({"trainers": "2"}, "trainers", "--trainers", "expected int, got '2'"),
        ({"lr": True}, "lr", "--lr", "expected float, got True"),
        ({"batch_size": 100, "trainers": 3}, "batch_size", "--batch-size", "positive multiple of trainers"),
        ({"sync": "later"}, "sync", "--sync", "expected one of delayed, critical, got 'later'"),
        ({"table_rows": (5, 5)}, "table_rows", "--table-rows", "expected 26 values for synthetic data"),
        ({"embedding_servers": 0}, "embedding_servers", "--embedding-servers", "must be >= 1"),
        ({"model": "wdl", "top_mlp": (8, 1)}, "top_mlp", "--top-mlp", "belongs to --model dlrm"),
        ({"bottom_mlp": (32, 8)}, "bottom_mlp", "--bottom-mlp", "must equal embedding_dim (16)"),
        ({"lookahead": 500}, "lookahead", "--lookahead", "over --max-lookahead 200"),
        ({"eval_every": 5}, "eval_every", "--eval-every", "needs --eval-data"),
        (
            {"data": "criteo:a.tsv", "eval_data": "avazu:b.csv"},
            "eval_data",
            "--eval-data",
            "not in the format",
        ),
        ({"shuffle_seed": 3}, "shuffle_seed", "--shuffle-seed", "applies to files"),
        ({"momentum": 0.9}, "momentum", "--momentum", "is not supported"),
        ({"embedding_server_priority": "low"}, "embedding_server_priority", None, "expected one of"),
    ],
)
def test_a_bad_value_is_refused_as_the_config_is_built(
    keywords: dict[str, object], field: str, flag: str | None, why: str
) -> None:
    with pytest.raises(ConfigError) as err:
        RunConfig(**keywords)  # type: ignore[arg-type]
    assert err.value.field == field and why in err.value.why and str(err.value).startswith(f"{field}: ")
    assert err.value.flag == (flag or "--" + field.replace("_", "-"))


def test_lists_become_the_tuples_the_flags_parse_to() -> None:
    rows = [40] * 26
    config = RunConfig(table_rows=rows, model="dcn", deep_mlp=[16, 8])  # type: ignore[arg-type]
    assert config.table_rows == tuple(rows) and config.deep_mlp == (16, 8)
    assert config == cli.parse_run(
        ["--table-rows", ",".join(map(str, rows)), "--model", "dcn", "--deep-mlp", "16,8"]
    )


def test_resume_takes_the_stopped_runs_config_and_this_invocations_display(tmp_path: Path) -> None:
    stopped = RunConfig(trainers=4, batch_size=256, iterations=40, quiet=False, report=True)
    (tmp_path / "config.json").write_text(json.dumps({**stopped.to_json(), "_record": {"git_revision": "x"}}))
    resumed = RunConfig(resume=str(tmp_path), quiet=True, report=False).resumed()
    assert resumed == dataclasses.replace(stopped, resume=str(tmp_path), quiet=True, report=False)


def test_a_config_json_from_before_report_and_with_unknown_flags(tmp_path: Path) -> None:
    old = {**RunConfig().to_json(), "no_report": True, "command": "run", "tls_ca": None}
    del old["report"]
    assert RunConfig.from_json(old).report is False
    with pytest.raises(ValueError, match="config.json: not a flag of bagpipe run: colour"):
        RunConfig.from_json({"colour": "red"})
    with pytest.raises(ValueError, match="resume: .*config.json not found"):
        RunConfig(resume=str(tmp_path / "nothing")).resumed()
