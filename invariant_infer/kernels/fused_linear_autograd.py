"""Autograd for ``silu_mul_linear``: the fused forward, and a backward built from the unfused kernels.

The forward is ``silu_mul_linear`` (silu(gate) * up computed in the down projection's prologue),
bitwise ``linear(silu_mul(gate, up), W, b)``. The backward recomputes h = silu_mul(gate, up), bitwise
the values the prologue fed the matmul, and then runs the same fixed-order kernels as the
unfused pair would: dh = dY @ W and dW = dY^T @ h from ``linear_autograd``, d gate and d up from the
elementwise ``silu_mul`` backward. So the fused MLP trains to the same bits as the unfused one,
and only [tokens x intermediate] of h exists during the backward, never in the forward.
"""
from __future__ import annotations

import torch

from .configs import LinearConfig
from .fused_linear import silu_mul_linear
from .linear_autograd import grad_bias, grad_input, grad_weight
from .silu_mul import silu_mul
from .silu_mul_autograd import silu_mul_backward


class SiluMulLinearFunction(torch.autograd.Function):
    """``silu_mul_linear`` with the batch-invariant, deterministic backward of the unfused pair."""

    @staticmethod
    def forward(ctx, gate, up, weight, bias=None, config=None):
        ctx.save_for_backward(gate, up, weight)
        ctx.has_bias = bias is not None
        return silu_mul_linear(gate, up, weight, bias, config=config)

    @staticmethod
    def backward(ctx, grad_y):
        gate, up, weight = ctx.saved_tensors
        n, k = weight.shape
        grad_y2 = grad_y.reshape(-1, n)
        d_gate = d_up = dw = db = None
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
            dh = grad_input(grad_y2, weight).reshape(gate.shape)
            d_gate, d_up = silu_mul_backward(gate, up, dh)
        if ctx.needs_input_grad[2]:
            dw = grad_weight(grad_y2, silu_mul(gate, up).reshape(-1, k))
        if ctx.has_bias and ctx.needs_input_grad[3]:
            db = grad_bias(grad_y2)
        return d_gate, d_up, dw, db, None


def silu_mul_linear_autograd(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor,
                             bias: torch.Tensor | None = None, *, config: LinearConfig | None = None) -> torch.Tensor:
    """Differentiable ``silu_mul_linear``: the fused forward's bits, the unfused pair's gradients.
    ``config`` is the forward's tile config (the MLP passes the row-parallel tree's)."""
    return SiluMulLinearFunction.apply(gate, up, weight, bias, config)
