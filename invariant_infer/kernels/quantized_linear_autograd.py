"""Autograd for the quantized linear layer: the input gradient through a frozen quantized weight.

The forward is the caller's quantized forward (the same kernels, the same bits as inference).
The backward is ``dX = dY @ dequant(W)``: the weight is dequantized once per backward by
``dequantize_weight`` (the values the weight-only GEMM multiplies, bitwise compressed-tensors'
decompression), cast to dY's dtype, and multiplied by the invariant linear kernel on its
transposed view, reduced over N in an order fixed by the shape alone: a row's input gradient
never depends on the other rows. For layers that also quantize their activations this is the
straight-through estimate (the rounding of x is not differentiated), as QLoRA-style training uses.
The quantized weight itself gets no gradient; a bias that requires grad gets the fixed-order row sum.
"""
from __future__ import annotations

import torch

from .linear_autograd import grad_bias, grad_input
from .quantized_linear import QuantizedWeight, dequantize_weight


class QuantizedLinearFunction(torch.autograd.Function):
    """``forward(x)`` (a quantized layer's forward) with ``dX = dY @ dequant(W)`` as its backward."""

    @staticmethod
    def forward(ctx, x, bias, weight: QuantizedWeight, forward):
        ctx.weight, ctx.x_shape, ctx.has_bias = weight, x.shape, bias is not None
        return forward(x)

    @staticmethod
    def backward(ctx, grad_y):
        n = ctx.weight.shape[0]
        grad_y2 = grad_y.reshape(-1, n)
        dx = db = None
        if ctx.needs_input_grad[0]:
            dense = dequantize_weight(ctx.weight).to(grad_y.dtype)
            dx = grad_input(grad_y2, dense).reshape(ctx.x_shape)
        if ctx.has_bias and ctx.needs_input_grad[1]:
            db = grad_bias(grad_y2)
        return dx, db, None, None


def quantized_linear_autograd(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None, forward):
    """``forward(x)``, which autograd differentiates with respect to ``x`` (and ``bias``) only."""
    return QuantizedLinearFunction.apply(x, bias, weight, forward)
