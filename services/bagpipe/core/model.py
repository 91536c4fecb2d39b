"""The recommendation models, with their embedding rows passed in from outside.

(Over 400 lines: the four built-in models and the user's class share one interface and one builder.)

The embedding tables do not live in the modules: the trainer gathers the rows of a batch from its cache
(the single-process reference from full tables), so the same module serves both and the dense parameters
are all a trainer owns. Every model, built-in or the user's own (``--model MODULE:CLASS``), is a
``torch.nn.Module`` with one interface:

* ``forward(dense, embedded)``: the batch's dense features [b, num_dense] (float32, already log(1+x)) and
  one embedding per table [b, num_tables, embedding_dim] give one logit per sample [b];
* with the class attribute ``first_order = True``, ``forward(dense, embedded, first_order)``: also each
  category's first-order weight [b, num_tables] (W&D's wide part, DeepFM's linear term).

A stored row is the category's ``embedding_dim`` vector, then its first-order weight for the models that
have one, so that a category's parameters and optimizer state travel as one row; ``row_logits`` hands a
model its rows so split. The interchange checkpoint keeps that column apart, under ``"linear"`` (see
core/checkpoint.py). A model class of the user's is built as ``Class(num_dense=..., num_tables=...,
embedding_dim=...)`` with torch's random generator seeded by ``seed`` (``build_model``).

* ``dlrm`` — facebookresearch/dlrm: bottom MLP on the dense features (ReLU after every layer), dot
  products of every pair of [bottom output, embeddings] (strictly lower triangle) concatenated with the
  bottom output, top MLP (ReLU after every layer but the last, which has one output).
  Names: ``bottom_mlp.<k>.weight|bias``, ``top_mlp.<k>.weight|bias``.
* ``wdl`` — Wide&Deep (Cheng et al. 2016): logit = wide + deep. Wide: ``wide`` Linear(num_dense, 1) on the
  dense features plus the sum of the categories' first-order weights. Deep: ``deep_mlp`` (ReLU after every
  layer) on [dense, the embeddings flattened in table order], then ``deep_out`` Linear(last, 1).
* ``deepfm`` — DeepFM (Guo et al. 2017): logit = first order + second order + deep. First order:
  ``linear`` Linear(num_dense, 1) plus the sum of the first-order weights. Second order (the factorisation
  machine over the embedding fields): ½·Σ_d[(Σ_t v_td)² − Σ_t v_td²]. Deep: as W&D's.
* ``dcn`` — Deep & Cross (Wang et al. 2017): x0 = [dense, embeddings flattened]. Cross layers
  x_{l+1} = x0·(x_l·w_l) + b_l + x_l with ``cross.<l>.weight`` and ``cross.<l>.bias`` (vectors of x0's
  size); the deep tower ``deep_mlp`` (ReLU after every layer) on x0; ``combine`` Linear on [x_L, deep
  output] gives the logit.

Every Linear is initialised as in the DLRM reference (weights N(0, 2/(fan_in+fan_out)), biases
N(0, 1/fan_out)); cross weights N(0, 2/(size+1)) and cross biases 0; all from ``seed`` alone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from numba import njit
from torch import nn

from bagpipe.core.interaction import pair_dots_backward, pair_dots_forward

# (re-exported: the configuration lives in model_config.py, which does not load torch)
from bagpipe.core.model_config import (  # noqa: F401
    DEFAULT_CROSS_LAYERS,
    DEFAULT_DEEP_MLP,
    LINEAR_MODELS,
    MODELS,
    ModelConfig,
    is_builtin,
    model_class,
)

logger = logging.getLogger(__name__)

# the name DLRM-only code knew this by
DLRMConfig = ModelConfig


def _mlp(in_size: int, sizes: tuple[int, ...]) -> nn.ModuleList:
    layers = nn.ModuleList()
    for size in sizes:
        layers.append(nn.Linear(in_size, size))
        in_size = size
    return layers


def _relu_all(layers: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    for layer in layers:
        x = F.relu(layer(x))
    return x


class _Model(nn.Module):
    """Shared initialisation: every Linear in registration order, then the cross layers."""

    first_order = False  # (see the module's docstring)

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config

    def reset_parameters(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, nn.Linear):
                    fan_out, fan_in = module.weight.shape
                    module.weight.normal_(0.0, (2.0 / (fan_in + fan_out)) ** 0.5, generator=gen)
                    module.bias.normal_(0.0, (1.0 / fan_out) ** 0.5, generator=gen)
                elif isinstance(module, CrossLayer):
                    size = module.weight.numel()
                    module.weight.normal_(0.0, (2.0 / (size + 1)) ** 0.5, generator=gen)
                    module.bias.zero_()


class _PairDots(torch.autograd.Function):
    """The dot products of every pair of a sample's features, strictly lower triangle:
    [b, f, d] -> [b, f(f-1)/2], in ``torch.tril_indices`` order (``lower`` is that order's positions in a
    flattened f x f matrix, ``upper`` their mirror images).

    Autograd through ``bmm(x, x^T)[:, rows, cols]`` takes two batched products (x's gradient through
    each factor), adds them and scatters through advanced indexing. The gradient of ``x_i . x_j`` is
    ``x_j`` for ``x_i`` and ``x_i`` for ``x_j``, so one product with the symmetric gradient matrix gives
    the same sum. The two differ only in the order of rounding."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, lower: torch.Tensor, upper: torch.Tensor
    ) -> torch.Tensor:
        ctx.save_for_backward(x, lower, upper)
        b, f, _ = x.shape
        return torch.bmm(x, x.transpose(1, 2)).view(b, f * f).index_select(1, lower)

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor, None, None]:
        x, lower, upper = ctx.saved_tensors  # type: ignore[attr-defined]
        b, f, _ = x.shape
        mirrored = grad.new_zeros(b, f * f)
        mirrored.index_copy_(1, lower, grad)
        mirrored.index_copy_(1, upper, grad)
        return torch.bmm(mirrored.view(b, f, f), x), None, None


class _CompiledPairDots(torch.autograd.Function):
    """``_PairDots`` of ``cat([bottom[:, None], rows], 1)`` on the CPU in float32, by the compiled loops of
    core/interaction.py (no concatenation, each pair once, the sums in registers). With ``inverse``,
    ``rows`` are the batch's unique rows and sample s's are rows[inverse[s]], read by index; their
    gradient is summed straight into the unique rows, in the order ``_BatchRows``' backward sums it."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        bottom: torch.Tensor,
        rows: torch.Tensor,
        inverse: torch.Tensor | None,
    ) -> torch.Tensor:
        bottom, rows = bottom.contiguous(), rows.contiguous()
        index = None if inverse is None else inverse.contiguous()
        ctx.save_for_backward(bottom, rows, index)  # type: ignore[arg-type]  # (None is saved as None)
        features = (rows.shape[1] if index is None else index.shape[1]) + 1
        out = bottom.new_empty(bottom.shape[0], features * (features - 1) // 2)
        pair_dots_forward(bottom.detach().numpy(), rows.detach().numpy(), _numpy(index), out.numpy())
        return out

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, None]:
        bottom, rows, index = ctx.saved_tensors  # type: ignore[attr-defined]
        bottom, rows = bottom.detach(), rows.detach()
        grad_bottom, grad_rows = torch.empty_like(bottom), torch.empty_like(rows)
        pair_dots_backward(
            bottom.numpy(),
            rows.numpy(),
            _numpy(index),
            grad.detach().contiguous().numpy(),
            grad_bottom.numpy(),
            grad_rows.numpy(),
        )
        return grad_bottom, grad_rows, None


def _numpy(index: torch.Tensor | None) -> np.ndarray | None:
    return None if index is None else index.numpy()


def pair_dots(
    bottom: torch.Tensor,
    rows: torch.Tensor,
    lower: torch.Tensor,
    upper: torch.Tensor,
    inverse: torch.Tensor | None = None,
) -> torch.Tensor:
    """DLRM's dot interaction: the dots of every pair of [bottom [b, d], rows [b, t, d]], strictly lower
    triangle, in ``tril_indices`` order (``lower``/``upper``: see ``_PairDots``). With ``inverse`` [b, t],
    ``rows`` are the batch's unique rows [u, d] instead, sample s's being rows[inverse[s]]: the same as
    passing ``batch_rows(rows, inverse)``, bit for bit, without making that [b, t, d] copy on the CPU."""
    compiled = bottom.device.type == "cpu" and bottom.dtype == rows.dtype == torch.float32
    if inverse is not None:
        if compiled and inverse.device.type == "cpu" and inverse.dtype == torch.int64:
            return _CompiledPairDots.apply(bottom, rows, inverse)  # type: ignore[no-any-return]
        rows = batch_rows(rows, inverse)
    if compiled:
        return _CompiledPairDots.apply(bottom, rows, None)  # type: ignore[no-any-return]
    features = torch.cat([bottom.unsqueeze(1), rows], dim=1)
    return _PairDots.apply(features, lower, upper)  # type: ignore[no-any-return]


@njit(cache=True, nogil=True)
def _sum_rows(out, index, grad):  # type: ignore[no-untyped-def]
    """out = 0, then out[index[n]] += grad[n] for n in order: ``index_add_``'s additions in its order
    (the same bits), about four times as fast on the CPU for a batch's 26 k rows of 64."""
    out[:] = 0
    rows = out.shape[0]
    for n in range(index.size):
        r = index[n]
        if r < 0 or r >= rows:
            raise IndexError("batch_rows: an index is outside the rows")
        o, g = out[np.uint64(r)], grad[n]  # (checked: unsigned, without wrap-around code)
        for k in range(g.size):
            o[k] += g[k]


class _BatchRows(torch.autograd.Function):
    """``rows[inverse]`` ([u, w] by [b, t] -> [b, t, w]) whose backward sums the gradients into [u, w]
    in the order of ``inverse``, as advanced indexing's ``index_put_`` with accumulation does: on the CPU
    by a compiled loop (float32) or ``index_add_``, both faster. On CUDA, where ``index_add_`` adds in no
    fixed order, the backward is advanced indexing's own."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, rows: torch.Tensor, inverse: torch.Tensor
    ) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        ctx.num_rows = rows.shape[0]  # type: ignore[attr-defined]
        return rows.index_select(0, inverse.reshape(-1)).view(*inverse.shape, rows.shape[1])

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor, None]:
        (inverse,) = ctx.saved_tensors  # type: ignore[attr-defined]
        flat = grad.reshape(-1, grad.shape[-1])
        index = inverse.reshape(-1)
        if not grad.is_cuda and grad.dtype == torch.float32 and index.dtype == torch.int64:
            out = grad.new_empty(ctx.num_rows, grad.shape[-1])  # type: ignore[attr-defined]
            _sum_rows(out.numpy(), index.contiguous().numpy(), flat.detach().contiguous().numpy())
            return out, None
        out = grad.new_zeros(ctx.num_rows, grad.shape[-1])  # type: ignore[attr-defined]
        if grad.is_cuda:
            out.index_put_((index,), flat, accumulate=True)
        else:
            out.index_add_(0, index, flat)
        return out, None


def batch_logits(
    model: nn.Module, dense: torch.Tensor, rows: torch.Tensor, inverse: torch.Tensor
) -> torch.Tensor:
    """``row_logits(model, dense, batch_rows(rows, inverse))``: a batch's logits from its unique rows
    [u, w] and ``inverse`` [b, t] (positions in ``rows``), differentiable in ``rows``. DLRM reads the rows
    by index in its interaction instead of gathering them first (``DLRM.forward_unique``): the same
    bits."""
    if isinstance(model, DLRM):
        return model.forward_unique(dense, rows, inverse)
    return row_logits(model, dense, batch_rows(rows, inverse))


def row_logits(model: nn.Module, dense: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``model``'s logits [b] from the batch's rows as stored [b, t, w]: ``model(dense, embedded)``, or
    with ``first_order``, ``model(dense, embedded, first_order)`` (the rows' last column apart)."""
    if getattr(model, "first_order", False):
        logits = model(dense, rows[..., :-1], rows[..., -1])
    else:
        logits = model(dense, rows)
    if not isinstance(logits, torch.Tensor) or logits.shape != dense.shape[:1]:
        got = list(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(
            f"model: {type(model).__qualname__}.forward returned {got}, expected one logit per sample "
            f"[{dense.shape[0]}]"
        )
    return logits


def batch_rows(rows: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """The batch's rows [b, t, w] from its unique rows [u, w] and ``inverse`` [b, t] (positions in
    ``rows``); differentiable in ``rows``."""
    return _BatchRows.apply(rows, inverse)  # type: ignore[no-any-return]


class DLRM(_Model):
    """Bottom MLP, dot interaction (strict lower triangle), top MLP; returns logits."""

    _tril_lower: torch.Tensor
    _tril_upper: torch.Tensor

    def __init__(self, config: ModelConfig, seed: int = 0) -> None:
        super().__init__(config)
        self.bottom_mlp = _mlp(config.num_dense, config.bottom_mlp)
        self.top_mlp = _mlp(config.interaction_size, config.top_mlp)
        features = config.num_tables + 1
        rows, cols = torch.tril_indices(features, features, offset=-1)
        self.register_buffer("_tril_lower", rows * features + cols, persistent=False)
        self.register_buffer("_tril_upper", cols * features + rows, persistent=False)
        self.reset_parameters(seed)

    def forward(self, dense: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        """dense [b, num_dense], embedded [b, num_tables, dim] -> logits [b]."""
        return self.forward_unique(dense, embedded, None)

    def forward_unique(
        self, dense: torch.Tensor, rows: torch.Tensor, inverse: torch.Tensor | None
    ) -> torch.Tensor:
        """``forward(dense, batch_rows(rows, inverse))`` from the batch's unique rows [u, dim] and
        ``inverse`` [b, num_tables] (with ``inverse`` None, ``rows`` are the batch's [b, num_tables, dim]).
        The interaction reads the rows by index (``pair_dots``): the same bits, without the gathered copy."""
        x = _relu_all(self.bottom_mlp, dense)
        dots = pair_dots(x, rows, self._tril_lower, self._tril_upper, inverse)
        z = torch.cat([x, dots], dim=1)
        for k, layer in enumerate(self.top_mlp):
            z = layer(z)
            if k < len(self.top_mlp) - 1:
                z = F.relu(z)
        return z.squeeze(1)


class _LinearAndDeep(_Model):
    """A first-order part (a Linear on the dense features, named ``linear_name``, plus the categories'
    first-order weights) beside a deep tower on [dense, embeddings flattened]: W&D and DeepFM."""

    first_order = True
    linear_name = "wide"

    def __init__(self, config: ModelConfig, seed: int = 0) -> None:
        super().__init__(config)
        self.add_module(self.linear_name, nn.Linear(config.num_dense, 1))
        self.deep_mlp = _mlp(config.flat_size, config.deep_mlp)
        self.deep_out = nn.Linear(config.deep_mlp[-1], 1)
        self.reset_parameters(seed)

    def _logit(self, dense: torch.Tensor, embedded: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The logit of the first-order part plus the deep tower."""
        deep = _relu_all(self.deep_mlp, torch.cat([dense, embedded.flatten(1)], dim=1))
        linear = getattr(self, self.linear_name)
        return (linear(dense) + self.deep_out(deep)).squeeze(1) + weights.sum(1)


class WideAndDeep(_LinearAndDeep):
    """Wide (linear on dense features + first-order weights) plus deep (MLP on dense + embeddings)."""

    def forward(self, dense: torch.Tensor, embedded: torch.Tensor, first_order: torch.Tensor) -> torch.Tensor:
        return self._logit(dense, embedded, first_order)


class DeepFM(_LinearAndDeep):
    """First order (linear on dense features + first-order weights), FM second order, deep MLP."""

    linear_name = "linear"

    def forward(self, dense: torch.Tensor, embedded: torch.Tensor, first_order: torch.Tensor) -> torch.Tensor:
        logit = self._logit(dense, embedded, first_order)
        return logit + 0.5 * (embedded.sum(1).pow(2) - embedded.pow(2).sum(1)).sum(1)


class CrossLayer(nn.Module):
    """x_{l+1} = x0 · (x_l · w) + b + x_l (DCN's cross layer; w and b have x0's size)."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))
        self.bias = nn.Parameter(torch.empty(size))

    def forward(self, x0: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return x0 * (x @ self.weight).unsqueeze(1) + self.bias + x


class DeepCross(_Model):
    """Cross network and deep tower side by side on [dense, embeddings], combined by one Linear."""

    def __init__(self, config: ModelConfig, seed: int = 0) -> None:
        super().__init__(config)
        self.cross = nn.ModuleList(CrossLayer(config.flat_size) for _ in range(config.cross_layers))
        self.deep_mlp = _mlp(config.flat_size, config.deep_mlp)
        self.combine = nn.Linear(config.flat_size + config.deep_mlp[-1], 1)
        self.reset_parameters(seed)

    def forward(self, dense: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        x0 = torch.cat([dense, rows.flatten(1)], dim=1)
        x = x0
        for layer in self.cross:
            x = layer(x0, x)
        deep = _relu_all(self.deep_mlp, x0)
        return self.combine(torch.cat([x, deep], dim=1)).squeeze(1)


# the built-in models by name
BUILTIN: dict[str, type[_Model]] = {"dlrm": DLRM, "wdl": WideAndDeep, "deepfm": DeepFM, "dcn": DeepCross}


def build_model(config: ModelConfig, seed: int = 0) -> nn.Module:
    """The model ``config.name`` names, initialised from ``seed``: a built-in from its sizes, a model class
    of the user's as ``Class(num_dense=..., num_tables=..., embedding_dim=...)`` with torch's random
    generator seeded by ``seed`` (and left as it was), so that every trainer builds the same one."""
    if is_builtin(config.name):
        builtin: Callable[[ModelConfig, int], nn.Module] = BUILTIN[config.name]
        return builtin(config, seed)
    cls = model_class(config.name)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(
            num_dense=config.num_dense, num_tables=config.num_tables, embedding_dim=config.embedding_dim
        )
    # (the trainers all-reduce every parameter's gradient, and torch's optimizers refuse none)
    frozen = [name for name, p in model.named_parameters() if not p.requires_grad]
    if frozen or not list(model.parameters()):
        why = f"frozen parameters {', '.join(frozen)}" if frozen else "no parameters"
        raise ValueError(f"model: {config.name}: has {why}; Bagpipe trains every dense parameter")
    return model


def batch_loss(logits: torch.Tensor, labels: torch.Tensor, global_batch_size: int) -> torch.Tensor:
    """This slice's share of the global batch's mean binary cross-entropy.

    Summing it over the trainers' slices gives the mean over the global batch, so summing gradients
    across trainers gives exactly the single-process gradient.
    """
    return F.binary_cross_entropy_with_logits(logits, labels, reduction="sum") / global_batch_size
