"""A server joining by a scale-up reads no checkpoint file: it holds no bucket of the job's shard map, and its
rows come from its peers. Every server is started with ``--resume-batch latest`` (so that one started again
after a failure loads the newest checkpoint); once it holds buckets, it reads the chain like any other.

The files a server opens are seen through Python's audit hook for ``open``, on a real checkpoint chain.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
from bagpipe.core import snapshots
from bagpipe.core.data import table_offsets
from bagpipe.core.optim_config import OptimizerConfig
from bagpipe.core.shard_map import ShardMap
from bagpipe.embedding_server.__main__ import build_store
from bagpipe.embedding_server.config import EmbeddingServerConfig
from bagpipe.embedding_server.shard_store import ShardStore

ROWS = (300, 200)
OFFSETS = table_offsets(list(ROWS))
KEYS = int(OFFSETS[-1])

_opened: list[Path] | None = None  # (the audit hook's record while a test listens; hooks stay for good)


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if _opened is not None and event == "open" and isinstance(args[0], (str, Path)):
        _opened.append(Path(args[0]))


sys.addaudithook(_audit)


def _config(shard: int, directory: Path) -> EmbeddingServerConfig:
    return EmbeddingServerConfig(
        shard,
        2,
        ROWS,
        4,
        OptimizerConfig("adagrad", 0.1),
        7,
        None,
        "127.0.0.1:0",
        checkpoint_dir=str(directory),
    )


def _chain(directory: Path, shard_map: ShardMap, cfg: EmbeddingServerConfig) -> dict[int, np.ndarray]:
    """Checkpoints 4 (full) and 8 (incremental) of two servers that trained under ``shard_map``; returns the
    rows and state of every key written, as checkpoint 8 holds them."""
    width = cfg.optimizer.state_width(cfg.row_width)
    stores = [ShardStore(shard_map, s, OFFSETS, cfg.row_width, width, cfg.seed) for s in (0, 1)]
    rng = np.random.default_rng(5)
    written: dict[int, np.ndarray] = {}
    for n, previous in ((4, 0), (8, 4)):
        keys = rng.choice(KEYS, size=60, replace=False).astype(np.int64)
        files = []
        for store in stores:
            mine = keys[shard_map.shard_of(keys) == store.shard]
            rows = rng.normal(size=(mine.size, cfg.row_width)).astype(np.float32)
            state = rng.random((mine.size, width)).astype(np.float32)
            store.write(mine, rows, state)
            written.update(
                {int(k): np.concatenate([r, s]) for k, r, s in zip(mine, rows, state, strict=True)}
            )
            full = previous == 0
            taken = store.take_all() if full else store.take_changes()
            files.append(snapshots.write_rows(directory, n, store.shard, *taken, full=full)[0])
        (snapshots.path_of(directory, n) / snapshots.DENSE).write_bytes(b"dense")
        snapshots.mark_complete(
            directory, n, {"previous": previous, "full": previous == 0, "row_files": files}
        )
    return written


def _build(cfg: EmbeddingServerConfig, shard_map: ShardMap, batch: int, directory: Path) -> tuple[Any, set]:
    """``build_store``'s store, and the files under ``directory`` it opened."""
    global _opened
    _opened = []
    try:
        store = build_store(cfg, shard_map, batch)
    finally:
        opened, _opened = _opened, None
    return store, {p.resolve() for p in opened if p.resolve().is_relative_to(directory.resolve())}


def test_a_server_joining_by_a_scale_up_reads_no_checkpoint_file(tmp_path: Path) -> None:
    two = ShardMap.create(KEYS, 2, num_buckets=16)
    written = _chain(tmp_path, two, _config(0, tmp_path))
    chain_files = {p.resolve() for p in snapshots.files_of(tmp_path, 8)}
    assert len(chain_files) == 4

    # the new shard 2, started with --resume-batch latest (8) while the map still has two shards
    joining, opened = _build(_config(2, tmp_path), two, 8, tmp_path)
    assert opened == set()
    assert joining.rows_held == 0

    # a server that holds rows reads the whole chain, and holds checkpoint 8's rows of its keys
    holding, opened = _build(_config(1, tmp_path), two, 8, tmp_path)
    assert chain_files <= opened
    mine = [k for k in written if two.shard_of(np.array([k]))[0] == 1]
    assert np.array_equal(
        holding.gather(np.array(mine, dtype=np.int64)), np.stack([written[k] for k in mine])
    )

    # once re-sharding gave it buckets, the joined server started again reads the chain like any other
    three = two.rebalance([0, 1, 2])
    rejoined, opened = _build(_config(2, tmp_path), three, 8, tmp_path)
    assert chain_files <= opened
    assert rejoined.rows_held > 0
    mine = [k for k in written if three.shard_of(np.array([k]))[0] == 2]
    assert mine, "the rebalanced map moves none of the written keys to shard 2"
    assert np.array_equal(
        rejoined.gather(np.array(mine, dtype=np.int64)), np.stack([written[k] for k in mine])
    )
