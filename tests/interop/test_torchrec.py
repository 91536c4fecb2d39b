"""TorchRec interop (issue 55): ``bagpipe export --to torchrec`` writes a state dict that TorchRec's own DLRM
loads strictly and that gives Bagpipe's logits; ``--init-from`` takes such a state dict back.

The test that builds TorchRec's model runs in TorchRec's own environment (bench/.venv-torchrec, made by
``make bench-torchrec-env``) and is skipped, saying so, where that is missing. Everything else runs here
without TorchRec: the mapping against a plain-torch copy of TorchRec's forward, the round trip, a real
``bagpipe run --init-from`` of an exported state dict, and the refusals.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from bagpipe.core import checkpoint, interop
from bagpipe.core.model import ModelConfig, build_model
from bagpipe.export import export, sidecar

ROOT = Path(__file__).resolve().parents[2]
TORCHREC_PYTHON = ROOT / "bench" / ".venv-torchrec" / "bin" / "python"
LOGITS_SCRIPT = Path(__file__).with_name("torchrec_logits.py")
TOLERANCE = 1e-5


def make_checkpoint(
    config: ModelConfig, table_rows: list[int], seed: int = 0, steps: int = 4
) -> dict[str, Any]:
    """An interchange checkpoint as ``--save-final`` writes it (no optimizer state): the model's dense
    parameters from ``seed`` and random tables, N(0, 0.25) (logits of a few units, as a trained model's;
    with N(0, 1) rows 26 tables give logits of 14 and float noise of 4e-6)."""
    model = build_model(config, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    ckpt: dict[str, Any] = {
        "dense": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "embeddings": {
            str(t): 0.5 * torch.randn(r, config.embedding_dim, generator=gen)
            for t, r in enumerate(table_rows)
        },
        "meta": {
            **config.describe(),
            "table_rows": table_rows,
            "embedding_dim": config.embedding_dim,
            "num_dense": config.num_dense,
            "optimizer_steps": steps,
            "steps": steps,
        },
    }
    if config.linear:
        ckpt["linear"] = {str(t): torch.randn(r, 1, generator=gen) for t, r in enumerate(table_rows)}
    return ckpt


def make_batch(config: ModelConfig, table_rows: list[int], size: int = 48, seed: int = 5) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "dense": torch.rand(size, config.num_dense, generator=gen).log1p(),
        "ids": torch.stack([torch.randint(0, r, (size,), generator=gen) for r in table_rows], dim=1),
    }


def bagpipe_logits(config: ModelConfig, ckpt: dict[str, Any], batch: dict[str, Any]) -> torch.Tensor:
    """Bagpipe's DLRM (``build_model``) on ``batch``, with the checkpoint's parameters and rows."""
    model = build_model(config)
    model.load_state_dict(ckpt["dense"])
    ids = batch["ids"]
    rows = torch.stack([ckpt["embeddings"][str(t)][ids[:, t]] for t in range(ids.shape[1])], dim=1)
    with torch.no_grad():
        return model(batch["dense"], rows)  # type: ignore[no-any-return]


def torchrec_style_logits(state: dict[str, torch.Tensor], batch: dict[str, Any]) -> torch.Tensor:
    """TorchRec 1.8's DLRM forward (torchrec/models/dlrm.py) written out in plain torch over its state
    dict: DenseArch (ReLU after every layer), InteractionArch (``triu_indices`` pairs after the dense
    output), OverArch (ReLU after all but its last Linear). Lets CI check the mapping without TorchRec."""

    def linear(prefix: str, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, state[prefix + "weight"], state[prefix + "bias"])

    x = batch["dense"]
    k = 0
    while f"{interop.DENSE_ARCH}{k}._linear.weight" in state:
        x = torch.relu(linear(f"{interop.DENSE_ARCH}{k}._linear.", x))
        k += 1
    ids = batch["ids"]
    sparse = torch.stack(
        [state[f"{interop.TABLES}t{t}.weight"][ids[:, t]] for t in range(ids.shape[1])], dim=1
    )
    combined = torch.cat([x.unsqueeze(1), sparse], dim=1)
    i, j = torch.triu_indices(combined.shape[1], combined.shape[1], offset=1)
    z = torch.cat([x, torch.bmm(combined, combined.transpose(1, 2))[:, i, j]], dim=1)
    k = 0
    while f"{interop.OVER_ARCH_MLP}{k}._linear.weight" in state:
        z = torch.relu(linear(f"{interop.OVER_ARCH_MLP}{k}._linear.", z))
        k += 1
    return linear(interop.OVER_ARCH_LAST, z).squeeze(1)


# (tables, dim, bottom MLP, top MLP): one table; several, with a deeper top MLP; Criteo's 26
SHAPES = [
    ([11], 4, (8, 4), (6, 1)),
    ([7, 9, 11, 5, 13], 8, (16, 8), (16, 4, 1)),
    ([3 + t for t in range(26)], 8, (16, 8), (16, 1)),
]


def shape_config(shape: tuple[list[int], int, tuple[int, ...], tuple[int, ...]]) -> ModelConfig:
    rows, dim, bottom, top = shape
    return ModelConfig(num_dense=13, num_tables=len(rows), embedding_dim=dim, bottom_mlp=bottom, top_mlp=top)


def exported(tmp_path: Path, name: str, ckpt: dict[str, Any]) -> Path:
    source, out = tmp_path / f"{name}.pt", tmp_path / f"{name}-torchrec.pt"
    checkpoint.save(source, ckpt)
    export(source, out)
    return out


def test_pair_permutation_maps_torchrec_pairs_onto_bagpipe_pairs() -> None:
    """TorchRec's pair m, (i, j) with i < j in triu order, is Bagpipe's pair perm[m], (j, i) in tril
    order: the same two features."""
    for tables in (1, 2, 5, 26):
        features = tables + 1
        perm = interop.pair_permutation(tables)
        i, j = torch.triu_indices(features, features, offset=1)
        rows, cols = torch.tril_indices(features, features, offset=-1)
        assert torch.equal(rows[perm], j) and torch.equal(cols[perm], i)
        assert sorted(perm.tolist()) == list(range(features * tables // 2))


@pytest.mark.parametrize("shape", SHAPES, ids=["1-table", "5-tables", "26-tables"])
def test_exported_state_dict_gives_bagpipe_logits_through_torchrec_forward(tmp_path: Path, shape) -> None:
    config, rows = shape_config(shape), shape[0]
    ckpt = make_checkpoint(config, rows, seed=len(rows))
    state = torch.load(exported(tmp_path, "m", ckpt), weights_only=True)
    batch = make_batch(config, rows)
    expected = bagpipe_logits(config, ckpt, batch)
    got = torchrec_style_logits(state, batch)
    assert float((got - expected).abs().max()) < TOLERANCE
    if len(rows) > 1:  # (the permutation matters: without it the logits differ)
        state[interop.OVER_ARCH_MLP + "0._linear.weight"] = ckpt["dense"]["top_mlp.0.weight"]
        assert float((torchrec_style_logits(state, batch) - expected).abs().max()) > 1e-3


def test_sidecar_says_how_to_build_torchrec_dlrm(tmp_path: Path) -> None:
    config, rows = shape_config(SHAPES[1]), SHAPES[1][0]
    out = exported(tmp_path, "m", make_checkpoint(config, rows))
    spec = json.loads(sidecar(out).read_text())
    assert spec["dense_in_features"] == 13
    assert spec["dense_arch_layer_sizes"] == [16, 8]
    assert spec["over_arch_layer_sizes"] == [16, 4, 1]
    assert spec["tables"] == [
        {
            "name": f"t{t}",
            "num_embeddings": r,
            "embedding_dim": 8,
            "feature_names": [f"f{t}"],
            "pooling": "SUM",
        }
        for t, r in enumerate(rows)
    ]
    state = torch.load(out, weights_only=True)
    assert list(state)[: len(rows)] == [f"{interop.TABLES}t{t}.weight" for t in range(len(rows))]


def test_torchrec_dlrm_loads_the_export_strictly_and_gives_bagpipe_logits(
    tmp_path: Path, torchrec_python: Path
) -> None:
    """TorchRec's own ``DLRM`` over an ``EmbeddingBagCollection``, built from the sidecar, takes the state
    dict with ``load_state_dict(strict=True)`` and scores a batch as Bagpipe's DLRM does."""
    argv, expected = [], []
    for n, shape in enumerate(SHAPES):
        config, rows = shape_config(shape), shape[0]
        ckpt = make_checkpoint(config, rows, seed=n)
        batch = make_batch(config, rows, seed=n)
        torch.save(batch, tmp_path / f"batch-{n}.pt")
        argv += [
            str(exported(tmp_path, f"m{n}", ckpt)),
            str(tmp_path / f"batch-{n}.pt"),
            str(tmp_path / f"logits-{n}.pt"),
        ]
        expected.append(bagpipe_logits(config, ckpt, batch))
    done = subprocess.run(
        [str(torchrec_python), str(LOGITS_SCRIPT), *argv],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for n, want in enumerate(expected):
        got = torch.load(tmp_path / f"logits-{n}.pt", weights_only=True)
        assert got.shape == want.shape
        difference = float((got - want).abs().max())
        print(f"shape {n}: max |TorchRec - Bagpipe| logit difference {difference:.3g}")
        assert difference < TOLERANCE


def test_torchrec_state_dict_maps_back_to_the_checkpoint_it_came_from(tmp_path: Path) -> None:
    config, rows = shape_config(SHAPES[1]), SHAPES[1][0]
    ckpt = make_checkpoint(config, rows)
    out = exported(tmp_path, "m", ckpt)
    back = checkpoint.load_init(out, "dlrm", 8, rows, config)
    assert "optimizer" not in back  # (TorchRec's state dict has none: the run's starts afresh)
    differences = checkpoint.max_abs_difference(ckpt, back)
    assert set(differences) == {f"dense/{k}" for k in ckpt["dense"]} | {f"embeddings/{t}" for t in range(5)}
    assert max(differences.values()) == 0.0
    model = build_model(config)
    model.load_state_dict(back["dense"], strict=True)


def test_torchrec_state_dict_with_a_prefix_and_sorted_keys_maps_back(tmp_path: Path) -> None:
    """``DLRMTrain`` keeps the DLRM under ``model.``; a state dict whose keys were sorted (t0, t1, t10, …)
    still gives the tables in their numbers' order."""
    rows = [3 + t for t in range(12)]
    config = ModelConfig(num_dense=13, num_tables=12, embedding_dim=4, bottom_mlp=(4,), top_mlp=(8, 1))
    ckpt = make_checkpoint(config, rows)
    state = torch.load(exported(tmp_path, "m", ckpt), weights_only=True)
    wrapped = OrderedDict((f"model.{k}", state[k]) for k in sorted(state))
    torch.save(wrapped, tmp_path / "wrapped.pt")
    back = checkpoint.load_init(tmp_path / "wrapped.pt", "dlrm", 4, rows, config)
    assert max(checkpoint.max_abs_difference(ckpt, back).values()) == 0.0


def test_init_from_a_torchrec_state_dict_starts_a_run_from_that_model(tmp_path: Path) -> None:
    """A real ``bagpipe run --init-from`` of an exported state dict: both trainers and both embedding
    servers read it, and the run's initial checkpoint is the original model, with fresh Adagrad state."""
    from bagpipe.cli import parse_run
    from bagpipe.local.launcher import run

    rows = [4 + t for t in range(26)]
    config = ModelConfig(num_dense=13, num_tables=26, embedding_dim=8, bottom_mlp=(16, 8), top_mlp=(16, 1))
    ckpt = make_checkpoint(config, rows, seed=3)
    out = exported(tmp_path, "m", ckpt)
    initial = tmp_path / "initial.pt"
    argv = [
        "--table-rows", ",".join(map(str, rows)), "--embedding-dim", "8", "--bottom-mlp", "16,8",
        "--top-mlp", "16,1", "--batch-size", "64", "--iterations", "1", "--trainers", "2",
        "--embedding-servers", "2", "--data-processors", "1", "--optimizer", "adagrad", "--quiet",
        "--no-report", "--log-level", "WARNING", "--run-dir", str(tmp_path / "run"),
        "--init-from", str(out), "--save-initial", str(initial),
    ]  # fmt: skip
    run(parse_run(argv))
    started = checkpoint.load(initial)
    assert (
        max(checkpoint.max_abs_difference(ckpt, {k: started[k] for k in ("dense", "embeddings")}).values())
        == 0
    )
    state = started["optimizer"]
    assert all(float(s["sum"].abs().max()) == 0 for s in state["embeddings"].values())
    assert all(float(s["sum"].abs().max()) == 0 for s in state["dense"].values())


@pytest.mark.parametrize(
    ("model", "reason"),
    [
        ("wdl", "TorchRec has no Wide&Deep model"),
        ("deepfm", "TorchRec.s SimpleDeepFMNN is another model"),
        ("dcn", "TorchRec.s DLRM_DCN is DLRM with a DCN-v2"),
    ],
)
def test_export_refuses_models_torchrec_does_not_have(tmp_path: Path, model: str, reason: str) -> None:
    config = ModelConfig(
        num_dense=13, num_tables=3, embedding_dim=4, name=model, deep_mlp=(8,), cross_layers=1
    )
    source, out = tmp_path / "m.pt", tmp_path / "out.pt"
    checkpoint.save(source, make_checkpoint(config, [5, 6, 7]))
    with pytest.raises(ValueError, match=f"cannot export --model {model} to TorchRec: {reason}"):
        export(source, out)
    assert not out.exists() and not sidecar(out).exists()


def test_export_refuses_a_one_layer_top_mlp(tmp_path: Path) -> None:
    config = ModelConfig(num_dense=13, num_tables=2, embedding_dim=4, bottom_mlp=(4,), top_mlp=(1,))
    source = tmp_path / "m.pt"
    checkpoint.save(source, make_checkpoint(config, [5, 6]))
    with pytest.raises(ValueError, match="OverArch needs at least two layers"):
        export(source, tmp_path / "out.pt")


def test_cli_export_writes_both_files_and_refuses_with_the_reason(tmp_path: Path) -> None:
    dlrm = tmp_path / "dlrm.pt"
    checkpoint.save(dlrm, make_checkpoint(shape_config(SHAPES[0]), SHAPES[0][0]))
    wdl = tmp_path / "wdl.pt"
    config = ModelConfig(num_dense=13, num_tables=2, embedding_dim=4, name="wdl", deep_mlp=(8,))
    checkpoint.save(wdl, make_checkpoint(config, [5, 6]))
    command = [sys.executable, "-m", "bagpipe.cli", "export", "--to", "torchrec"]
    done = subprocess.run([*command, str(dlrm), str(tmp_path / "o.pt")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "TorchRec DLRM state dict" in done.stdout
    assert (tmp_path / "o.pt").is_file() and (tmp_path / "o.pt.json").is_file()
    done = subprocess.run([*command, str(wdl), str(tmp_path / "w.pt")], capture_output=True, text=True)
    assert done.returncode == 1
    assert done.stderr.startswith(f"bagpipe export: {wdl}: cannot export --model wdl to TorchRec: ")
    assert not (tmp_path / "w.pt").exists()


def test_init_from_names_every_size_of_the_torchrec_model_that_differs(tmp_path: Path) -> None:
    config, rows = shape_config(SHAPES[1]), SHAPES[1][0]
    out = exported(tmp_path, "m", make_checkpoint(config, rows))
    wrong = [7, 9, 12, 5, 13]
    with pytest.raises(
        ValueError, match=r"table rows differ from --table-rows 7,9,12,5,13: t2 \(table 2\) has 11$"
    ):
        checkpoint.load_init(out, "dlrm", 8, wrong)
    with pytest.raises(ValueError, match=r"5 tables, the run has 26 .*; embedding dim 8, --embedding-dim 16"):
        checkpoint.load_init(out, "dlrm", 16, [5] * 26)
    other = ModelConfig(num_dense=13, num_tables=5, embedding_dim=8, bottom_mlp=(32, 8), top_mlp=(16, 1))
    with pytest.raises(
        ValueError, match=r"dense_arch layer sizes 16,8, --bottom-mlp 32,8; over_arch layer sizes "
    ):
        checkpoint.load_init(out, "dlrm", 8, rows, other)
    with pytest.raises(ValueError, match="only --model dlrm can start from it, not wdl"):
        checkpoint.load_init(out, "wdl", 8, rows)


def test_bagpipe_run_refuses_a_torchrec_state_dict_of_other_sizes_before_starting(tmp_path: Path) -> None:
    """The launcher checks ``--init-from`` as the services will load it: one line, no process started."""
    from bagpipe.cli import parse_run
    from bagpipe.local.launcher import run
    from bagpipe.local.validate import BadFlag

    rows = [4 + t for t in range(26)]
    config = ModelConfig(num_dense=13, num_tables=26, embedding_dim=8, bottom_mlp=(16, 8), top_mlp=(16, 1))
    out = exported(tmp_path, "m", make_checkpoint(config, rows))
    wrong = [*rows[:3], 99, *rows[4:]]
    argv = [
        "--table-rows", ",".join(map(str, wrong)), "--embedding-dim", "8", "--bottom-mlp", "16,8",
        "--top-mlp", "16,1", "--quiet", "--no-report", "--run-dir", str(tmp_path / "run"),
        "--init-from", str(out),
    ]  # fmt: skip
    with pytest.raises(BadFlag, match=r"--init-from: .*: table rows differ .*: t3 \(table 3\) has 7$"):
        run(parse_run(argv))
    assert not (tmp_path / "run").exists()


def test_init_from_refuses_torchrec_models_other_than_plain_dlrm(tmp_path: Path) -> None:
    config, rows = shape_config(SHAPES[1]), SHAPES[1][0]
    state = torch.load(exported(tmp_path, "m", make_checkpoint(config, rows)), weights_only=True)
    state["inter_arch.crossnet.W_kernels.0"] = torch.zeros(1)  # (DLRM_DCN's interaction)
    torch.save(state, tmp_path / "dcn.pt")
    with pytest.raises(ValueError, match="not TorchRec's plain DLRM .*inter_arch.crossnet.W_kernels.0"):
        checkpoint.load_init(tmp_path / "dcn.pt", "dlrm", 8, rows)
