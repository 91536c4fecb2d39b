"""The models and row-wise optimizers against stock PyTorch, in one process (no services).

Training with Bagpipe's row layout (a field's vector and first-order weight as one row, its optimizer
state beside it) and ``core.optim.apply_rows`` must equal ``core.reference`` (stock ``nn.Embedding``
tables, ``torch.optim`` dense optimizers, ``SparseAdam``), and the interchange checkpoint must round-trip
the row layout.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from bagpipe.core import checkpoint
from bagpipe.core.model import (
    MODELS,
    ModelConfig,
    batch_logits,
    batch_loss,
    batch_rows,
    build_model,
    pair_dots,
    row_logits,
)
from bagpipe.core.optim import (
    OPTIMIZERS,
    OptimizerConfig,
    apply_rows,
    compiled_rows,
    saved_state,
)

from tests.reference import train_reference

TABLES, ROWS, BATCH, DIM = 3, 20, 16, 4


def config(name: str) -> ModelConfig:
    if name == "dlrm":
        return ModelConfig(num_tables=TABLES, embedding_dim=DIM, bottom_mlp=(8, DIM), top_mlp=(8, 1))
    return ModelConfig(num_tables=TABLES, embedding_dim=DIM, name=name, deep_mlp=(8,), cross_layers=2)


def batches(n: int, seed: int = 0) -> list[SimpleNamespace]:
    rng = np.random.default_rng(seed)
    return [
        SimpleNamespace(
            dense=rng.random((BATCH, 13), dtype=np.float32),
            sparse=rng.integers(0, ROWS, (BATCH, TABLES)),
            labels=(rng.random(BATCH) < 0.5).astype(np.float32),
        )
        for _ in range(n)
    ]


def test_a_samples_interaction_does_not_depend_on_the_batch_around_it() -> None:
    """A trainer computes its slice of a batch, the reference the whole batch: each sample's dots and
    their gradients must be the same bits either way (the compiled loops on the CPU), and equal the
    batched product's (the path CUDA and float64 take) up to the order of rounding."""
    gen = torch.Generator().manual_seed(5)
    features = 27
    rows, cols = torch.tril_indices(features, features, offset=-1)
    lower, upper = rows * features + cols, cols * features + rows
    bottom = torch.randn(40, 64, generator=gen, requires_grad=True)
    embedded = torch.randn(40, features - 1, 64, generator=gen, requires_grad=True)
    weights = torch.randn(40, len(lower), generator=gen)
    whole = pair_dots(bottom, embedded, lower, upper)
    grads = torch.autograd.grad(whole, [bottom, embedded], weights)
    for part in (slice(0, 1), slice(7, 27), slice(39, 40)):
        b, e = bottom[part].detach().requires_grad_(), embedded[part].detach().requires_grad_()
        mine = pair_dots(b, e, lower, upper)
        assert torch.equal(mine, whole[part])
        for got, want in zip(torch.autograd.grad(mine, [b, e], weights[part]), grads, strict=True):
            assert torch.equal(got, want[part])
    as_double = [t.detach().double().requires_grad_() for t in (bottom, embedded)]
    batched = pair_dots(*as_double, lower, upper)  # (float64: the batched product)
    torch.testing.assert_close(whole.double(), batched.detach(), rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, torch.autograd.grad(batched, as_double, weights.double()), strict=True):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", MODELS)
def test_a_batch_from_its_unique_rows_gives_the_bits_of_its_gathered_rows(name: str) -> None:
    """``batch_logits`` (DLRM's interaction reading the unique rows by index, the other models gathering
    first) against ``row_logits(model, dense, batch_rows(rows, inverse))``: the same logits, and the same
    gradients for the unique rows and every dense parameter."""
    model_config = config(name)
    model = build_model(model_config, seed=3)
    gen = torch.Generator().manual_seed(4)
    unique = torch.randn(11, model_config.row_width, generator=gen)
    inverse = torch.randint(0, 11, (BATCH, TABLES), generator=gen)
    dense = torch.rand(BATCH, 13, generator=gen)
    outcomes = []
    for logits_of in (
        lambda rows: row_logits(model, dense, batch_rows(rows, inverse)),
        lambda rows: batch_logits(model, dense, rows, inverse),
    ):
        rows = unique.clone().requires_grad_()
        logits = logits_of(rows)
        grads = torch.autograd.grad(logits.square().sum(), [rows, *model.parameters()])
        outcomes.append((logits.detach(), grads))
    (want_logits, want_grads), (logits, grads) = outcomes
    assert torch.equal(logits, want_logits)
    for got, want in zip(grads, want_grads, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("name", MODELS)
def test_row_layout_and_row_optimizer_equal_stock_pytorch(name: str, optimizer: str) -> None:
    model_config, optim = config(name), OptimizerConfig(optimizer, 0.05)
    model = build_model(model_config, seed=1)
    width = model_config.row_width
    assert width == DIM + (name in ("wdl", "deepfm"))
    table = torch.randn(TABLES * ROWS, width, generator=torch.Generator().manual_seed(2)) * 0.1
    initial: dict = {"dense": {k: v.clone() for k, v in model.state_dict().items()}}
    for t in range(TABLES):
        checkpoint.put_table(
            initial, t, table[t * ROWS : (t + 1) * ROWS], torch.zeros(ROWS, 0), DIM, (), model_config.linear
        )
    data = batches(4)
    expected = train_reference(initial, data, model_config, optim)

    dense_opt = optim.dense_optimizer(list(model.parameters()))
    weights, state = table.clone(), torch.zeros(TABLES * ROWS, optim.state_width(width))
    for step, b in enumerate(data, start=1):
        keys = torch.from_numpy(b.sparse + np.arange(TABLES) * ROWS)
        unique, inverse = torch.unique(keys, return_inverse=True)
        rows = weights[unique].clone().requires_grad_()
        logits = row_logits(model, torch.from_numpy(b.dense), batch_rows(rows, inverse))
        loss = batch_loss(logits, torch.from_numpy(b.labels), BATCH)
        dense_opt.zero_grad()
        loss.backward()
        dense_opt.step()
        apply_rows(optim, weights, state, unique, rows.grad, step)
    got: dict = {
        "dense": model.state_dict(),
        "optimizer": {"dense": saved_state(dense_opt, dict(model.named_parameters()))},
    }
    step_count = len(data) if optimizer == "adam" else None
    for t in range(TABLES):
        part = slice(t * ROWS, (t + 1) * ROWS)
        checkpoint.put_table(
            got, t, weights[part], state[part], DIM, optim.state_keys, model_config.linear, step_count
        )
    diffs = checkpoint.max_abs_difference(got, expected)
    assert max(diffs.values()) < 1e-6, {k: v for k, v in diffs.items() if v >= 1e-6}
    if model_config.linear:
        assert "linear" in expected and all(v.shape == (ROWS, 1) for v in expected["linear"].values())
    # and the checkpoint's sections join back into the stored rows and state
    for t in range(TABLES):
        part = slice(t * ROWS, (t + 1) * ROWS)
        assert torch.equal(checkpoint.table_rows(got, t, DIM, model_config.linear), weights[part])
        saved = checkpoint.table_state(got, t, optim.state_keys, model_config.linear)
        if optim.state_keys:
            assert saved is not None and torch.equal(saved[0], state[part])
            assert saved[1] == (len(data) if optimizer == "adam" else 0)
        else:
            assert saved is None


def test_the_batch_gather_and_dlrm_interaction_equal_autograd_through_stock_indexing() -> None:
    """The trainer's own backward passes (a gather summed by a compiled loop in ``index_add_``'s order,
    the dot interaction compiled on the CPU) against autograd through the stock expressions; the
    equivalence tests above would not see a wrong one, since the reference runs the same model."""
    gen = torch.Generator().manual_seed(3)
    rows = torch.randn(11, 5, generator=gen, requires_grad=True)
    inverse = torch.randint(0, 11, (7, 3), generator=gen)
    grad = torch.randn(7, 3, 5, generator=gen)
    ours = batch_rows(rows, inverse)
    (mine,) = torch.autograd.grad(ours, rows, grad)
    (stock,) = torch.autograd.grad(rows[inverse], rows, grad)
    assert torch.equal(ours, rows[inverse])
    assert torch.equal(mine, stock)  # the same additions, in the same order
    as_double = rows.detach().double().requires_grad_()
    assert torch.autograd.gradcheck(lambda r: batch_rows(r, inverse), (as_double,))

    model = build_model(config("dlrm"), seed=4)
    dense = torch.randn(6, 13, generator=gen)
    embedded = torch.randn(6, TABLES, DIM, generator=gen, requires_grad=True)

    def stock(dense: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        x = dense
        for layer in model.bottom_mlp:
            x = torch.relu(layer(x))
        features = torch.cat([x.unsqueeze(1), embedded], dim=1)
        rows, cols = torch.tril_indices(TABLES + 1, TABLES + 1, offset=-1)
        z = torch.cat([x, torch.bmm(features, features.transpose(1, 2))[:, rows, cols]], dim=1)
        for k, layer in enumerate(model.top_mlp):
            z = layer(z) if k == len(model.top_mlp) - 1 else torch.relu(layer(z))
        return z.squeeze(1)

    out, expected = model(dense, embedded), stock(dense, embedded)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)  # (compiled dots: lanes add apart)
    weights = torch.randn(6, generator=gen)
    got = torch.autograd.grad(out, [embedded, *model.parameters()], weights)
    want = torch.autograd.grad(expected, [embedded, *model.parameters()], weights)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)  # (the rounding order differs)
    model.double()
    as_double = embedded.detach().double().requires_grad_()
    assert torch.autograd.gradcheck(lambda e: model(dense.double(), e), (as_double,))


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_the_compiled_row_updates_equal_the_tensor_expressions(optimizer: str) -> None:
    """Every state column bit for bit. A weight within the rounding of its update: torch's vectorised
    sqrt is now and then a unit in the last place off (the compiled loop's is correctly rounded),
    which moves the sum by at most that share of the update and one more rounding."""
    optim = OptimizerConfig(optimizer, 0.05)
    gen = torch.Generator().manual_seed(5)
    rows, dim = 3000, 16
    weights = torch.randn(rows, dim, generator=gen)
    state = torch.rand(rows, optim.state_width(dim), generator=gen)
    ours, theirs = (weights.clone(), state.clone()), (weights.clone(), state.clone())
    for step in range(1, 6):
        index = torch.randperm(rows, generator=gen)[: rows // 2]
        grad = torch.randn(index.numel(), dim, generator=gen) * 10.0 ** -(step % 3)
        assert compiled_rows(*ours, index, grad)
        before = theirs[0].clone()
        apply_rows(optim, *ours, index, grad, step)
        apply_rows(optim, *theirs, index, grad, step, compiled=False)
        assert torch.equal(ours[1], theirs[1])
        ulp = torch.nextafter(theirs[0].abs(), torch.tensor(float("inf"))) - theirs[0].abs()
        allowed = 2 * ulp + 2.5e-7 * (theirs[0] - before).abs()
        assert bool(((ours[0] - theirs[0]).abs() <= allowed).all())
        assert not torch.equal(theirs[0], before)
        ours[0].copy_(theirs[0])  # (so that the next step starts equal)
    # a gradient that is not contiguous, or on another dtype, takes the tensor expressions
    assert not compiled_rows(*ours, index, grad.t().contiguous().t())
    assert not compiled_rows(ours[0].double(), ours[1].double(), index, grad.double())


def test_adam_state_layout_and_which_columns_must_be_non_negative() -> None:
    adam = OptimizerConfig("adam", 1e-3)
    assert adam.state_keys == ("exp_avg", "exp_avg_sq") and adam.state_width(5) == 10
    assert adam.non_negative_columns(5) == slice(5, 10)  # the second moment, not the first
    assert OptimizerConfig("adagrad").non_negative_columns(4) == slice(0, 4)
    assert adam.epsilon == 1e-8 and OptimizerConfig("adagrad").epsilon == 1e-10


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"name": "sgd", "momentum": 0.9}, "momentum: 0.9 is not supported"),
        ({"name": "adam", "weight_decay": 0.01}, "weight_decay: 0.01 is not supported"),
        ({"name": "rmsprop"}, "optimizer: must be one of sgd, adagrad, adam"),
        ({"name": "adam", "lr": float("nan")}, "lr: must be a finite number > 0"),
    ],
)
def test_optimizers_that_cannot_stay_exact_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        OptimizerConfig(**kwargs)


def test_model_configs_are_checked() -> None:
    with pytest.raises(ValueError, match="model: must be one of dlrm, wdl, deepfm, dcn"):
        ModelConfig(name="fm")
    with pytest.raises(ValueError, match=r"bottom_mlp: the last size \(16\) must equal embedding_dim \(8\)"):
        ModelConfig(embedding_dim=8)
    assert ModelConfig(name="wdl").deep_mlp == (256, 256, 256)
    with pytest.raises(ValueError, match="cross_layers: must be >= 1"):
        ModelConfig(name="dcn", cross_layers=0)


def test_a_checkpoint_of_another_model_is_named_when_it_does_not_fit() -> None:
    ckpt = {"embeddings": {"0": torch.zeros(5, DIM)}}
    with pytest.raises(ValueError, match=r"linear/0: expected a \[5, 1\] tensor"):
        checkpoint.table_rows(ckpt, 0, DIM, linear=True)
    with pytest.raises(ValueError, match=r"embeddings/0: expected a \[rows, 6\] tensor, got \(5, 4\)"):
        checkpoint.table_rows(ckpt, 0, 6, linear=False)


def test_a_server_takes_a_negative_first_moment_but_refuses_a_negative_second_one() -> None:
    from bagpipe.core.data import table_offsets
    from bagpipe.core.shard_map import ShardMap
    from bagpipe.embedding_server.shard_store import ShardStore
    from bagpipe.errors import InvalidArgument

    adam = OptimizerConfig("adam", 1e-3)
    store = ShardStore(
        ShardMap.create(40, 1, num_buckets=8), 0, table_offsets([20, 20]), DIM, adam.state_width(DIM), 1
    )
    store.non_negative = adam.non_negative_columns(DIM)
    keys, rows = np.array([3, 25]), np.zeros((2, DIM), dtype=np.float32)
    state = np.zeros((2, 2 * DIM), dtype=np.float32)
    state[:, :DIM] = -0.5  # exp_avg may be negative
    store.write(keys, rows, state)
    assert np.array_equal(store.lookup(keys)[1], state)
    bad = state.copy()
    bad[1, DIM + 2] = -1e-3
    with pytest.raises(InvalidArgument, match=r"state: key 25: value -0.001 \(must be finite and >= 0\)"):
        store.write(keys, rows + 1, bad)
    assert np.array_equal(store.lookup(keys)[0], rows), "a refused write changes nothing"
