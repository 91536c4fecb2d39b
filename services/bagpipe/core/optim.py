"""Optimizers for embedding rows that live outside any nn.Parameter, with torch.optim semantics.

A row's optimizer state has one block of the row's width per entry of ``STATE_KEYS`` (Adagrad's sum of
squares; Adam's two moments) and travels with it between embedding server and cache; ``state_width``
tells how many floats per row that is. The arithmetic mirrors ``torch.optim.SGD``/``Adagrad`` on sparse
gradients and ``torch.optim.SparseAdam`` (the lazy row-wise Adam: only the rows a batch uses move, with
the bias correction of the global step count), so results match them.

Momentum and weight decay are refused: applied lazily to the rows a batch uses they would differ from
the dense torch optimizers a synchronous reference uses (a row's decay would depend on when it is used),
so no Bagpipe run could promise the synchronous model with them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from numba import njit

from bagpipe.core.intrinsics import fma

# (re-exported: the settings live in optim_config.py, which does not load torch)
from bagpipe.core.optim_config import (  # noqa: F401
    DEFAULT_EPS,
    NON_NEGATIVE,
    OPTIMIZERS,
    STATE_KEYS,
    OptimizerConfig,
)


# (error_model="numpy": a division by zero gives inf or nan, as in torch, rather than a check per
# element that keeps the loop from being vectorised)
@njit(cache=True, nogil=True, error_model="numpy")
def _adagrad_rows(weights, state, index, grad, alpha, eps):  # type: ignore[no-untyped-def]
    """Adagrad on the rows at ``index``, float32 throughout, in the tensor expressions' order."""
    for j in range(index.size):
        r = index[j]
        for d in range(grad.shape[1]):
            g = grad[j, d]
            total = fma(g, g, state[r, d])  # (as torch's addcmul_)
            state[r, d] = total
            weights[r, d] = fma(g / (np.sqrt(total) + eps), alpha, weights[r, d])


@njit(cache=True, nogil=True, error_model="numpy")
def _adam_rows(weights, state, index, grad, alpha, eps, keep1, keep2):  # type: ignore[no-untyped-def]
    """SparseAdam on the rows at ``index`` (as ``_adagrad_rows``)."""
    dim = grad.shape[1]
    for j in range(index.size):
        r = index[j]
        for d in range(dim):
            g = grad[j, d]
            m = state[r, d]
            m = m + (g - m) * keep1
            v = state[r, dim + d]
            v = v + (g * g - v) * keep2
            state[r, d] = m
            state[r, dim + d] = v
            weights[r, d] = fma(m / (np.sqrt(v) + eps), alpha, weights[r, d])


def _adam_step_size(config: OptimizerConfig, step: int) -> float:
    beta1, beta2 = config.betas
    return config.lr * math.sqrt(1 - beta2**step) / (1 - beta1**step)


def compiled_rows(
    weights: torch.Tensor, state: torch.Tensor, index: torch.Tensor, grad: torch.Tensor
) -> bool:
    """Whether ``apply_rows`` can update these tensors with its compiled loops: float32 on the CPU,
    contiguous (the cache's tables and a gradient gathered from autograd's), int64 positions."""
    return (
        weights.dtype == state.dtype == grad.dtype == torch.float32
        and index.dtype == torch.int64
        and all(t.device.type == "cpu" and t.is_contiguous() for t in (weights, state, index, grad))
    )


def apply_rows(
    config: OptimizerConfig,
    weights: torch.Tensor,
    state: torch.Tensor,
    index: torch.Tensor,
    grad: torch.Tensor,
    step: int = 1,
    compiled: bool = True,
) -> None:
    """Updates ``weights[index]`` (and ``state[index]``) in place from the summed gradient ``grad``.

    ``index`` holds distinct row positions; ``grad`` is [len(index), dim]; ``step`` is the global
    optimizer step this update is (1 for the first batch), for Adam's bias correction.

    Adagrad and Adam run as compiled loops where ``compiled_rows`` allows (on the CPU) unless
    ``compiled`` is False: one pass over each row, without temporaries, where the tensor expressions
    below take seven to ten (0.11–0.16 against 0.7–1.7 ms for Adagrad on 3,373 rows of 64). The loops
    round every operation correctly; torch's vectorised ``sqrt`` is off by one unit in the last place
    now and then, so the two can differ in a weight's last bit. Every Bagpipe system runs the same
    loops; CUDA runs the tensor expressions.
    """
    if compiled and config.name != "sgd" and compiled_rows(weights, state, index, grad):
        f32 = np.float32
        w, s, i, g = (t.detach().numpy() for t in (weights, state, index, grad))
        if config.name == "adagrad":
            _adagrad_rows(w, s, i, g, f32(-config.lr), f32(config.epsilon))
        else:
            beta1, beta2 = config.betas
            alpha = f32(-_adam_step_size(config, step))
            _adam_rows(w, s, i, g, alpha, f32(config.epsilon), f32(1 - beta1), f32(1 - beta2))
        return
    if config.name == "sgd":
        weights.index_add_(0, index, grad, alpha=-config.lr)
        return
    if config.name == "adagrad":
        total = state.index_select(0, index).addcmul_(grad, grad)
        state.index_copy_(0, index, total)
        weights.index_add_(0, index, grad / total.sqrt().add_(config.epsilon), alpha=-config.lr)
        return
    # SparseAdam: m += (1-b1)(g-m); v += (1-b2)(g^2-v); w -= lr*sqrt(1-b2^t)/(1-b1^t) * m/(sqrt(v)+eps)
    beta1, beta2 = config.betas
    dim = weights.shape[1]
    old = state.index_select(0, index)
    m, v = old[:, :dim], old[:, dim:]
    m.add_(grad.sub(m).mul_(1 - beta1))
    v.add_(grad.pow(2).sub_(v).mul_(1 - beta2))
    state.index_copy_(0, index, old)
    weights.index_add_(0, index, m / v.sqrt().add_(config.epsilon), alpha=-_adam_step_size(config, step))


class DenseOptimizer:
    """SGD, Adagrad or Adam for the trainer's dense parameters on the CPU: torch.optim's single-tensor
    arithmetic (the path it takes for CPU tensors), the same operations in the same order, so the
    results are the same to the bit (``tests/unit/core/test_dense_optimizer.py``), and the same state
    per parameter (``state[p]``: Adagrad ``step``, ``sum``; Adam ``step``, ``exp_avg``, ``exp_avg_sq``).

    Why not torch.optim itself: its ``add_param_group``, ``step`` and ``zero_grad`` import
    ``torch._dynamo`` on first use, 1.1 s on an idle core and about 2 s while a job's services start
    beside the trainer, which waits for nothing else then (bench/README.md, "Start-up and the data
    processors"). Parameters on a GPU keep torch.optim (``dense_optimizer``), whose foreach kernels the
    reference uses there too.
    """

    def __init__(self, config: OptimizerConfig, params: list[torch.nn.Parameter]) -> None:
        self.config = config
        self.params = list(params)
        self.state: dict[torch.Tensor, dict[str, Any]] = {}
        if config.name == "adagrad":  # (torch.optim.Adagrad makes its state up front, Adam on first use)
            for p in self.params:
                self.state[p] = {
                    "step": torch.tensor(0.0),
                    "sum": torch.zeros_like(p, memory_format=torch.preserve_format),
                }

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
                continue
            if p.grad.grad_fn is not None:
                p.grad.detach_()
            else:
                p.grad.requires_grad_(False)
            p.grad.zero_()

    @torch.no_grad()
    def step(self) -> None:
        """One step for every parameter with a gradient, as torch.optim's ``step()``."""
        config = self.config
        lr = config.lr
        for p in self.params:
            grad = p.grad
            if grad is None:
                continue
            if config.name == "sgd":
                p.add_(grad, alpha=-lr)
            elif config.name == "adagrad":
                state = self.state[p]
                state["step"] += 1
                total = state["sum"]
                total.addcmul_(grad, grad, value=1)
                p.addcdiv_(grad, total.sqrt().add_(config.epsilon), value=-lr)  # (lr_decay 0: lr itself)
            else:
                self._adam(p, grad)

    def _adam(self, p: torch.Tensor, grad: torch.Tensor) -> None:
        beta1, beta2 = (float(b) for b in self.config.betas)
        state = self.state.get(p)
        if state is None:
            state = self.state[p] = {
                "step": torch.tensor(0.0),
                "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
            }
        state["step"] += 1
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        step = state["step"].item()
        step_size = self.config.lr / (1 - beta1**step)
        denom = (exp_avg_sq.sqrt() / (1 - beta2**step) ** 0.5).add_(self.config.epsilon)
        p.addcdiv_(exp_avg, denom, value=-step_size)


Optimizer = torch.optim.Optimizer | DenseOptimizer


def dense_optimizer(
    config: OptimizerConfig, params: list[torch.nn.Parameter], device: torch.device
) -> Optimizer:
    """The trainer's optimizer for ``params``: ``DenseOptimizer`` on the CPU, torch.optim elsewhere."""
    if device.type == "cpu":
        return DenseOptimizer(config, params)
    return config.dense_optimizer(params)


def _kind(optimizer: Optimizer) -> str:
    """Which arithmetic ``optimizer`` runs: sgd, adagrad, adam (dense) or sparse_adam."""
    if isinstance(optimizer, DenseOptimizer):
        return optimizer.config.name
    for cls, kind in (
        (torch.optim.SparseAdam, "sparse_adam"),
        (torch.optim.Adam, "adam"),
        (torch.optim.Adagrad, "adagrad"),
    ):
        if isinstance(optimizer, cls):
            return kind
    return "sgd"


# per kind, the state entries a checkpoint keeps of each parameter (Adagrad's step is not kept: it
# does not enter its arithmetic without lr_decay)
_SAVED = {
    "adagrad": ("sum",),
    "adam": ("step", "exp_avg", "exp_avg_sq"),
    "sparse_adam": ("step", "exp_avg", "exp_avg_sq"),
}


def saved_state(optimizer: Optimizer, params: Mapping[str, torch.Tensor]) -> dict[str, dict[str, Any]]:
    """The checkpoint's optimizer entries, ``{name: torch's state of that parameter}`` on the CPU
    (Adagrad: ``sum``; Adam: ``step``, ``exp_avg``, ``exp_avg_sq``; nothing for SGD)."""
    kind = _kind(optimizer)
    out: dict[str, dict[str, Any]] = {}
    for name, p in params.items():
        state = optimizer.state.get(p, {})
        entries = {
            k: (v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v)
            for k, v in state.items()
            if k != "step" or kind in ("adam", "sparse_adam")
        }
        if entries:
            out[name] = entries
    return out


def restore_state(optimizer: Optimizer, params: Mapping[str, torch.Tensor], saved: Mapping[str, Any]) -> None:
    """Seeds the optimizer's state from a checkpoint's entries so training resumes exactly. Entries of
    another optimizer (an Adagrad checkpoint continued with Adam) are ignored: that one starts afresh."""
    kind = _kind(optimizer)
    wanted = _SAVED.get(kind, ())
    for name, p in params.items():
        entry = saved.get(name, {})
        if not wanted or not all(k in entry for k in wanted):
            continue
        state: dict[str, Any] = {}
        for k in wanted:
            v = entry[k]
            state[k] = v.clone().to(p.device) if isinstance(v, torch.Tensor) and k != "step" else v
        if kind == "adam":
            state["step"] = torch.as_tensor(float(entry["step"]), dtype=torch.float32)
        elif kind == "sparse_adam":
            state["step"] = int(entry["step"])
        else:
            state["step"] = torch.tensor(0.0)
        optimizer.state[p] = state


def steps_taken(optimizer: Optimizer) -> int:
    """Adam's step count (the same for every dense parameter: each gets a gradient every step); 0 else."""
    if _kind(optimizer) != "adam":
        return 0
    for state in optimizer.state.values():
        if "step" in state:
            return int(state["step"])
    return 0
