"""One config path: each service's ``parse`` returns its config, ``argv`` writes the command line that
parses back to it, and the launcher starts every process of ``bagpipe run`` that way."""

from __future__ import annotations

from pathlib import Path

import pytest
from bagpipe import cli
from bagpipe.config_args import Coordination
from bagpipe.core.model import ModelConfig
from bagpipe.core.optim import OptimizerConfig
from bagpipe.data_processor import config as data_processor
from bagpipe.data_processor.config import DataProcessorConfig, SourceConfig
from bagpipe.embedding_server import config as embedding_server
from bagpipe.embedding_server.config import EmbeddingServerConfig
from bagpipe.local import configs
from bagpipe.local.configs import checkpoint_every
from bagpipe.oracle_cacher import config as oracle
from bagpipe.oracle_cacher.config import OracleConfig
from bagpipe.trainer import config as trainer
from bagpipe.trainer.config import TrainerConfig

ROWS = tuple(range(3, 29))
MODEL_CLASS = "tests.unit.core.test_model_class"  # (its model classes)
WHERE = Coordination("redis://10.0.0.2:7000/3", "job-7", "DEBUG", "10.1.2.3", "0.0.0.0:9100")


def test_trainer_round_trip() -> None:
    cfgs = [
        TrainerConfig(
            0,
            1,
            "tcp://127.0.0.1:1",
            ModelConfig(),
            OptimizerConfig(),
            tuple([10] * 26),
            0,
            None,
            None,
            None,
            "auto",
        ),
        TrainerConfig(
            rank=2,
            world_size=4,
            dist_init="tcp://10.0.0.1:29500",
            model=ModelConfig(13, 26, 8, (32, 8), (16, 4, 1)),
            optimizer=OptimizerConfig("adam", 0.003, eps=1e-6),
            table_rows=ROWS,
            seed=11,
            init_from="/m/init.pt",
            save_initial="/m/a.pt",
            save_final="/m/b.pt",
            device="cpu",
            coordination=WHERE,
            cache_rows=5000,
            iteration_log="/m/it.csv",
            fetch="synchronous",
            shared_table="/dev/shm/x",
            transfer_batches=3,
            checkpoint_dir=None,
            collective_timeout=12.5,
            eval_data="synthetic",
            eval_every=7,
            eval_samples=999,
            serve_after_done=True,
        ),
        TrainerConfig(
            1,
            2,
            "env://",
            ModelConfig(1, 22, 4, name="dcn", deep_mlp=(9, 5), cross_layers=2),
            OptimizerConfig("adagrad", 0.5),
            tuple([7] * 22),
            3,
            None,
            None,
            None,
            "cuda",
            data="avazu:/d/a.csv,/d/b.csv",
            dist_backend="gloo",
        ),
    ]
    for cfg in cfgs:
        assert trainer.parse(trainer.argv(cfg)) == cfg


def test_embedding_server_round_trip() -> None:
    cfg = EmbeddingServerConfig(
        shard=3,
        initial_shards=5,
        table_rows=ROWS,
        embedding_dim=12,
        optimizer=OptimizerConfig("adagrad", 0.25, eps=1e-7),
        seed=9,
        init_from="/m/i.pt",
        address="10.0.0.9:0",
        coordination=WHERE,
        data="criteo:/d/day_0",
        migration_rows_per_second=1e5,
        max_abs_value=1e3,
        model="deepfm",
        cpu_priority="idle",
    )
    assert embedding_server.parse(embedding_server.argv(cfg)) == cfg
    plain = EmbeddingServerConfig(0, 1, ROWS, 16, OptimizerConfig(), 0, None, "127.0.0.1:0")
    assert embedding_server.parse(embedding_server.argv(plain)) == plain


def test_oracle_round_trip() -> None:
    for cfg in (
        OracleConfig(ROWS, 64, 4, None, 2, 0),
        OracleConfig(
            ROWS,
            96,
            3,
            17,
            1,
            300,
            "0.0.0.0:7",
            WHERE,
            "criteo:/x",
            cache_rows=777,
            max_lookahead=50,
            reuse_delay=5,
            cache_mode="replicated",
            delayed_sync=False,
            checkpoint_every=20,
            eval_every=30,
            start_batch=40,
        ),
    ):
        assert oracle.parse(oracle.argv(cfg)) == cfg


def test_data_processor_round_trip() -> None:
    for cfg in (
        DataProcessorConfig(SourceConfig("synthetic", ROWS, seed=4, zipf_alpha=1.3), 32, 1),
        DataProcessorConfig(
            SourceConfig("synthetic", ROWS, hot_fraction=0.01, hot_share=0.9), 32, None, coordination=WHERE
        ),
        DataProcessorConfig(
            SourceConfig("criteo:/a,/b", ROWS, skip_bad_rows=True, shuffle_seed=5, shuffle_buffer=100), 8, 0
        ),
    ):
        assert data_processor.parse(data_processor.argv(cfg)) == cfg


@pytest.mark.parametrize(
    "flags",
    [
        [],
        [
            "--system",
            "no-cache",
            "--trainers",
            "4",
            "--batch-size",
            "64",
            "--model",
            "wdl",
            "--optimizer",
            "adam",
            "--lr",
            "0.01",
        ],
        ["--system", "ideal", "--lookahead", "9", "--cache-rows", "4000", "--sync", "critical"],
        [
            "--eval-data",
            "synthetic",
            "--eval-every",
            "5",
            "--checkpoint-every",
            "10",
            "--model",
            "dcn",
            "--deep-mlp",
            "12,6",
            "--cross-layers",
            "4",
            "--hot-fraction",
            "0.1",
            "--hot-share",
            "0.8",
        ],
        ["--model", f"{MODEL_CLASS}:FineFirstOrder", "--embedding-dim", "8", "--optimizer", "adagrad"],
    ],
)
def test_bagpipe_run_starts_each_service_with_the_config_it_built(flags: list[str], tmp_path: Path) -> None:
    args = cli.parse_run(flags)
    every = checkpoint_every(args)  # (none for the shared-memory ideal system)
    spec = configs.GenerationSpec("redis://127.0.0.1:6399/0", "job-x", every, tmp_path / "ck", tmp_path)
    built = [
        (embedding_server, configs.embedding_server(args, spec, 1)),
        (
            embedding_server,
            configs.embedding_server(args, spec, 2, netns_addresses="10.9.0.1,10.9.0.2"),
        ),
        (data_processor, configs.data_processor(args, spec, 1)),
        (oracle, configs.oracle(args, spec)),
        (trainer, configs.trainer(args, spec, 0, "tcp://127.0.0.1:29999")),
    ]
    for module, cfg in built:
        assert module.parse(module.argv(cfg)) == cfg, module.__name__
    trainer_cfg, oracle_cfg = built[-1][1], built[-2][1]
    assert isinstance(trainer_cfg, TrainerConfig) and isinstance(oracle_cfg, OracleConfig)
    system = getattr(args, "system", "bagpipe")
    assert (trainer_cfg.fetch == "synchronous") == (system == "no-cache")
    assert (trainer_cfg.shared_table is not None) == (system == "ideal")
    assert oracle_cfg.lookahead == (1 if system == "no-cache" else args.lookahead)
    assert trainer_cfg.model.name == args.model and trainer_cfg.optimizer.name == args.optimizer
    netns = built[1][1]
    assert isinstance(netns, EmbeddingServerConfig) and netns.address == "10.9.0.2:0"
    # the servers share the trainers' cores: idle priority, but the no-cache baseline waits for each fetch
    assert netns.cpu_priority == ("normal" if system == "no-cache" else "idle")
    # a joining server has the checkpoints too: a roll-back may rebuild its shard from them
    assert netns.coordination.redis_url == "redis://10.9.0.1:6399/0"
    assert netns.checkpoint_dir == spec.checkpoint_dir and netns.resume_batch == 0


@pytest.mark.parametrize(("name", "width"), [("Fine", 8), ("FineFirstOrder", 9)])
def test_a_model_class_reaches_every_process_with_its_row_width(
    name: str, width: int, tmp_path: Path
) -> None:
    """``--model MODULE:CLASS``: the servers store rows as wide as its ``first_order`` says, the trainers
    build it; both read it back from their command lines."""
    args = cli.parse_run(["--model", f"{MODEL_CLASS}:{name}", "--embedding-dim", "8"])
    spec = configs.GenerationSpec("redis://127.0.0.1:6399/0", "job-x", 0, tmp_path / "ck", tmp_path)
    server = embedding_server.parse(embedding_server.argv(configs.embedding_server(args, spec, 0)))
    trained = trainer.parse(trainer.argv(configs.trainer(args, spec, 0, "tcp://127.0.0.1:29999")))
    assert server.model == trained.model.name == f"{MODEL_CLASS}:{name}"
    assert server.row_width == trained.model.row_width == width
    assert server.linear == trained.model.linear == (width == 9)


def test_a_bad_value_names_its_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        oracle.parse(["--batch-size", "10", "--trainers", "3"])
    assert "--batch-size: must be a positive multiple of trainers (3), got 10" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "priority"),
    [
        ([], "idle"),
        (["--embedding-server-priority", "normal"], "normal"),
        (["--system", "no-cache"], "normal"),
        (["--system", "no-cache", "--embedding-server-priority", "idle"], "idle"),
        (["--system", "ideal"], "idle"),
    ],
)
def test_the_embedding_servers_priority_follows_the_flag_and_the_system(
    flags: list[str], priority: str, tmp_path: Path
) -> None:
    args = cli.parse_run(flags)
    spec = configs.GenerationSpec("redis://127.0.0.1:6399/0", "job-x", 0, tmp_path / "ck", tmp_path)
    cfg = configs.embedding_server(args, spec, 0)
    assert cfg.cpu_priority == priority
    assert embedding_server.parse(embedding_server.argv(cfg)) == cfg


def test_an_unknown_priority_is_refused() -> None:
    with pytest.raises(ValueError, match="cpu_priority: one of normal, idle, got 'low'"):
        EmbeddingServerConfig(0, 1, ROWS, 16, OptimizerConfig(), 0, None, "127.0.0.1:0", cpu_priority="low")
