"""RMSNorm with a backward: the forward is ``rms_norm``'s kernel, the backward two Triton kernels.

With n = x * rstd (fp32) and y = weight * round(n), the rounding taken as the identity:
  * d x = rstd * (dn - n * mean(dn * n)) with dn = dy * weight, each row reduced on its own in
    the forward's blocks, so a row's input gradient never depends on the other rows;
  * d weight = sum over rows of dy * round(n): each program sums its own rows into one partial
    row, then a second kernel adds the partial rows in program order. No atomics: the same
    rows give the same bits every time (the grouping is fixed by the device and hidden size).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import launch, reduction_rows
from .rms_norm import _launch_params, _row_rstd, rms_norm


@triton.jit(do_not_specialize=["M"])
def _rms_norm_backward_kernel(x_ptr, w_ptr, dy_ptr, dx_ptr, part_ptr, stride_x, stride_dy, stride_dx, M, N, eps,
                              BLOCK_ROWS: tl.constexpr, BLOCK_N: tl.constexpr, WEIGHT_GRAD: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    rstd = _row_rstd(x, N, eps)
    normed = x * rstd[:, None]
    dn = dy * w[None, :]
    dx = rstd[:, None] * (dn - normed * (tl.sum(dn * normed, axis=1) / N)[:, None])
    tl.store(dx_ptr + rows[:, None] * stride_dx + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
    if WEIGHT_GRAD:
        # The forward's rounded normed x; rows past M load zeros and add nothing.
        rounded = normed.to(x_ptr.dtype.element_ty).to(tl.float32)
        tl.store(part_ptr + pid.to(tl.int64) * N + cols, tl.sum(dy * rounded, axis=0), mask=cols < N)


@triton.jit(do_not_specialize=["P"])
def _sum_partial_rows_kernel(part_ptr, out_ptr, P, N, BLOCK_N: tl.constexpr):
    """out[c] = sum of part[p, c] over p = 0, 1, ..., P - 1, added in that order."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for p in range(0, P):
        acc += tl.load(part_ptr + p * N + cols, mask=cols < N, other=0.0)
    tl.store(out_ptr + cols, acc.to(out_ptr.dtype.element_ty), mask=cols < N)


def rms_norm_backward(x: torch.Tensor, weight: torch.Tensor, eps: float, grad_out: torch.Tensor,
                      weight_grad: bool = True):
    """(d x, d weight or None) of ``rms_norm(x, weight, eps)`` for the output gradient ``grad_out``."""
    n = x.shape[-1]
    x2 = reduction_rows(x.reshape(-1, n))
    dy2 = reduction_rows(grad_out.reshape(-1, n))
    m = x2.shape[0]
    dx = torch.empty(x2.shape, device=x.device, dtype=x.dtype)
    block_rows, block_n, num_warps = _launch_params(x.device, n)
    programs = triton.cdiv(m, block_rows)
    partial = torch.empty((programs, n) if weight_grad else (1, 1), device=x.device, dtype=torch.float32)
    if m:
        launch(_rms_norm_backward_kernel, (programs,), x.device, x2, weight, dy2, dx, partial,
               x2.stride(0), dy2.stride(0), dx.stride(0), m, n, eps,
               BLOCK_ROWS=block_rows, BLOCK_N=block_n, WEIGHT_GRAD=weight_grad, num_warps=num_warps)
    dw = None
    if weight_grad:
        dw = torch.zeros_like(weight) if m == 0 else torch.empty_like(weight)
        if m:
            sum_block = min(block_n, 1024)
            launch(_sum_partial_rows_kernel, (triton.cdiv(n, sum_block),), x.device, partial, dw, programs, n,
                   BLOCK_N=sum_block)
    return dx.reshape(x.shape), dw


class RMSNormFunction(torch.autograd.Function):
    """``rms_norm`` (bitwise its forward) with a batch-invariant d x and a deterministic d weight."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return rms_norm(x, weight, eps)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight = ctx.saved_tensors
        dx, dw = rms_norm_backward(x, weight, ctx.eps, grad_out, weight_grad=ctx.needs_input_grad[1])
        return dx, dw, None


def rms_norm_autograd(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Differentiable ``rms_norm``: same forward bits, batch-invariant d x, run-to-run identical d weight."""
    return RMSNormFunction.apply(x, weight, eps)
