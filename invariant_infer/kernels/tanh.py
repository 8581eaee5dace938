"""tanh(x) (the poolers and classification heads of BERT and XLM-RoBERTa) as a kernel, forward only.

Elementwise, so invariant in principle; a kernel so every element runs the same code wherever it
sits in the batch (torch's CPU kernels split vectorized bodies from scalar tails, and the tail
moves with the batch shape). In fp32: 1 - 2 / (exp(2x) + 1) as ``gelu_tanh_mul`` computes it, and
below |x| = 1/8, where that form cancels to an absolute error of an ulp of 1, its Taylor series to
x^9 (the next term is under 2^-39 of x there); rounded once to the dtype.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gelu_tanh_mul import _tanh, elementwise


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
