"""Autograd for the batch-invariant linear layer: y = x @ W^T (+ bias).

The forward is ``linear`` itself (same kernel, same bits). The backward runs the same kernel on
transposed views, so every gradient is reduced in one order fixed by shapes alone:
  * dX = dY @ W: the kernel with weight W^T [K, N], reduced over N in the order fixed by
    (device, dtype, K, N): a row's input gradient never depends on the other rows.
  * dW = dY^T @ X: the kernel with x = dY^T [N, M] and weight X^T [K, M], reduced over the M rows
    in the order fixed by (device, dtype, K, M): the same micro-batch gives the same bits.
  * db = dY^T @ 1: the kernel with a weight of ones [1, M], reduced over the rows the same way.
No atomics anywhere. The kernel reads its operands through their strides, so the transposed
views need no copies; 3-D inputs [B, L, K] are flattened to M = B * L rows.
"""
from __future__ import annotations

import torch

from .configs import LinearConfig
from .linear import linear


def grad_input(grad_y2: torch.Tensor, weight: torch.Tensor, config: LinearConfig | None = None) -> torch.Tensor:
    """dX [M, K] = dY [M, N] @ W [N, K]; ``config`` overrides the per-shape table (tests only)."""
    return linear(grad_y2, weight.t(), config=config)


def grad_weight(grad_y2: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
    """dW [N, K] = dY^T @ X, summed over the rows in a fixed order."""
    if x2.shape[0] == 0:
        return x2.new_zeros((grad_y2.shape[1], x2.shape[1]))
    return linear(grad_y2.t(), x2.t())


def grad_bias(grad_y2: torch.Tensor) -> torch.Tensor:
    """db [N] = the rows of dY summed in a fixed order."""
    if grad_y2.shape[0] == 0:
        return grad_y2.new_zeros(grad_y2.shape[1])
    ones = grad_y2.new_ones((1, grad_y2.shape[0]))
    return linear(grad_y2.t(), ones)[:, 0]


class LinearFunction(torch.autograd.Function):
    """``linear`` with a batch-invariant, deterministic backward (see the module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, bias=None, config=None, grad_input_config=None):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        ctx.grad_input_config = grad_input_config
        return linear(x, weight, bias, config=config)

    @staticmethod
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        n, k = weight.shape
        grad_y2 = grad_y.reshape(-1, n)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = grad_input(grad_y2, weight, ctx.grad_input_config).reshape(x.shape)
        if ctx.needs_input_grad[1]:
            dw = grad_weight(grad_y2, x.reshape(-1, k))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = grad_bias(grad_y2)
        return dx, dw, db, None, None


def linear_autograd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                     config: LinearConfig | None = None,
                     grad_input_config: LinearConfig | None = None) -> torch.Tensor:
    """``linear`` that autograd differentiates through the invariant kernels.

    ``config`` (forward) and ``grad_input_config`` (dX) override the per-shape table; pass them
    only to study configs (tests use them for a deliberately M-dependent negative control)."""
    return LinearFunction.apply(x, weight, bias, config, grad_input_config)
