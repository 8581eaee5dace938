"""tanh(x) (the poolers and classification heads of BERT and XLM-RoBERTa) as a kernel, with its backward.

Elementwise, so invariant in principle; a kernel so every element runs the same code wherever it
sits in the batch (torch's CPU kernels split vectorized bodies from scalar tails, and the tail
moves with the batch shape). In fp32: 1 - 2 / (exp(2x) + 1) as ``gelu_tanh_mul`` computes it, and
below |x| = 1/8, where that form cancels to an absolute error of an ulp of 1, its Taylor series to
x^9 (the next term is under 2^-39 of x there); rounded once to the dtype. The backward computes
each element's gradient from that element alone: dy * sech(x)^2 = dy * 4 / (exp(x) + exp(-x))^2 in
fp32, which holds its relative accuracy where 1 - tanh(x)^2 cancels (large |x|) and gives 0, never
NaN, once exp overflows.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gelu_tanh_mul import _tanh, elementwise, elementwise_backward


@triton.jit(do_not_specialize=["M"])
def _tanh_kernel(x_ptr, y_ptr, stride_x, stride_y, M, N, BLOCK_ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = x * x
    # x - x^3/3 + 2x^5/15 - 17x^7/315 + 62x^9/2835, in Horner form; literals (a kernel reads no globals)
    series = x * (1.0 + x2 * (-0.3333333333333333 + x2 * (0.13333333333333333 + x2 * (-0.05396825396825397
                                                                                     + x2 * 0.021869488536155203))))
    y = tl.where(tl.abs(x) < 0.125, series, _tanh(x))
    tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


def tanh(x: torch.Tensor) -> torch.Tensor:
    """tanh(x), elementwise, in x's dtype."""
    return elementwise(_tanh_kernel, x)


@triton.jit(do_not_specialize=["M"])
def _tanh_backward_kernel(x_ptr, dy_ptr, dx_ptr, stride_x, stride_dy, stride_dx, M, N,
                          BLOCK_ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    cosh2 = tl.exp(x) + tl.exp(-x)  # 2 cosh(x); its square is inf past |x| ~ 44, the slope 0
    slope = 4.0 / (cosh2 * cosh2)
    tl.store(dx_ptr + rows[:, None] * stride_dx + cols[None, :], (dy * slope).to(dx_ptr.dtype.element_ty), mask=mask)


def tanh_backward(x: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    """d x of ``tanh(x)`` for the output gradient ``grad_out``."""
    return elementwise_backward(_tanh_backward_kernel, x, grad_out)


class TanhFunction(torch.autograd.Function):
    """``tanh`` (bitwise its forward) with the batch-invariant elementwise backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return tanh(x)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (x,) = ctx.saved_tensors
        return tanh_backward(x, grad_out)


def tanh_autograd(x: torch.Tensor) -> torch.Tensor:
    """Differentiable ``tanh``: same forward bits, batch-invariant, deterministic gradients."""
    return TanhFunction.apply(x)
