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


def saved_state(
    optimizer: torch.optim.Optimizer, params: Mapping[str, torch.Tensor]
) -> dict[str, dict[str, Any]]:
    """The checkpoint's optimizer entries, ``{name: torch's state of that parameter}`` on the CPU
    (Adagrad: ``sum``; Adam: ``step``, ``exp_avg``, ``exp_avg_sq``; nothing for SGD)."""
    out: dict[str, dict[str, Any]] = {}
    for name, p in params.items():
        state = optimizer.state.get(p, {})
        entries = {
            k: (v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v)
            for k, v in state.items()
            if k != "step" or isinstance(optimizer, (torch.optim.Adam, torch.optim.SparseAdam))
        }
        if entries:
            out[name] = entries
    return out


def restore_state(
    optimizer: torch.optim.Optimizer, params: Mapping[str, torch.Tensor], saved: Mapping[str, Any]
) -> None:
    """Seeds the optimizer's state from a checkpoint's entries so training resumes exactly. Entries of
    another optimizer (an Adagrad checkpoint continued with Adam) are ignored: that one starts afresh."""
    wanted = {
        torch.optim.Adagrad: ("sum",),
        torch.optim.Adam: ("step", "exp_avg", "exp_avg_sq"),
        torch.optim.SparseAdam: ("step", "exp_avg", "exp_avg_sq"),
    }.get(type(optimizer), ())
    for name, p in params.items():
        entry = saved.get(name, {})
        if not wanted or not all(k in entry for k in wanted):
            continue
        state: dict[str, Any] = {}
        for k in wanted:
            v = entry[k]
            state[k] = v.clone().to(p.device) if isinstance(v, torch.Tensor) and k != "step" else v
        if isinstance(optimizer, torch.optim.Adam):
            state["step"] = torch.as_tensor(float(entry["step"]), dtype=torch.float32)
        elif isinstance(optimizer, torch.optim.SparseAdam):
            state["step"] = int(entry["step"])
        else:
            state["step"] = torch.tensor(0.0)
        optimizer.state[p] = state


def steps_taken(optimizer: torch.optim.Optimizer) -> int:
    """Adam's step count (the same for every dense parameter: each gets a gradient every step); 0 else."""
    for state in optimizer.state.values():
        if "step" in state and isinstance(optimizer, torch.optim.Adam):
            return int(state["step"])
    return 0
