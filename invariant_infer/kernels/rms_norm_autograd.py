"""RMSNorm with a backward: the forward is ``rms_norm``'s kernel, the backward two Triton kernels.

With n = x * rstd (fp32) and y = weight * round(n), the rounding taken as the identity:
  * d x = rstd * (dn - n * mean(dn * n)) with dn = dy * weight, each row reduced on its own in
    the forward's blocks, so a row's input gradient never depends on the other rows;
  * d weight = sum over rows of dy * round(n), on a tree fixed by the row count M alone: the
    flattened rows cut into groups of ``GROUP_ROWS`` from row 0, each group summed in row order
    (in slices of the forward's BLOCK_ROWS rows: 1 on a GPU, so strictly row by row), then the
    groups' fp32 sums cut into groups of ``GROUP_ROWS`` again, level after level, until one row
    is left. No atomics. How many groups each program takes (``row_group_schedule``) is the
    schedule: a GPU runs one group per program (M / 64 programs), the interpreter all of them in
    one; every schedule gives the same bits.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .configs import tile_device
from .errors import InvalidArgumentError
from .launch import launch, reduction_rows
from .rms_norm import _launch_params, _row_rstd, rms_norm

GROUP_ROWS = 64  # rows per leaf of d weight's tree (and partial sums per node above the leaves)


@triton.jit(do_not_specialize=["M", "GROUPS", "GROUPS_PER_PROGRAM"])
def _rms_norm_backward_kernel(x_ptr, w_ptr, dy_ptr, dx_ptr, part_ptr, stride_x, stride_dy, stride_dx, M, N, eps,
                              GROUPS, GROUPS_PER_PROGRAM, BLOCK_ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                              WEIGHT_GRAD: tl.constexpr, GROUP_ROWS: tl.constexpr):
    """d x of every row of this program's groups; with WEIGHT_GRAD, each group's sum of dy * round(n)
    (its BLOCK_ROWS-row slices added in row order) into row ``group`` of the fp32 partials."""
    cols = tl.arange(0, BLOCK_N)
    w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    for g in range(0, GROUPS_PER_PROGRAM):
        group = tl.program_id(0).to(tl.int64) * GROUPS_PER_PROGRAM + g
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for first in range(0, GROUP_ROWS, BLOCK_ROWS):
            rows = group * GROUP_ROWS + first + tl.arange(0, BLOCK_ROWS)
            mask = (rows[:, None] < M) & (cols[None, :] < N)
            x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            rstd = _row_rstd(x, N, eps)
            normed = x * rstd[:, None]
            dn = dy * w[None, :]
            dx = rstd[:, None] * (dn - normed * (tl.sum(dn * normed, axis=1) / N)[:, None])
            tl.store(dx_ptr + rows[:, None] * stride_dx + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
            if WEIGHT_GRAD:
                # The forward's rounded normed x; rows past M load zeros and add nothing.
                rounded = normed.to(x_ptr.dtype.element_ty).to(tl.float32)
                acc += tl.sum(dy * rounded, axis=0)
        if WEIGHT_GRAD and group < GROUPS:
            tl.store(part_ptr + group * N + cols, acc, mask=cols < N)


@triton.jit(do_not_specialize=["R", "OUT_ROWS", "GROUPS_PER_PROGRAM"])
def _sum_row_groups_kernel(in_ptr, out_ptr, R, N, OUT_ROWS, GROUPS_PER_PROGRAM, BLOCK_ROWS: tl.constexpr,
                           BLOCK_N: tl.constexpr, GROUP_ROWS: tl.constexpr):
    """out[g, c] = the sum of in[r, c] over the rows r of group g (GROUP_ROWS rows from g * GROUP_ROWS),
    its BLOCK_ROWS-row slices added in row order; in is fp32 [R, N], out [OUT_ROWS, N] in its dtype."""
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    for g in range(0, GROUPS_PER_PROGRAM):
        group = tl.program_id(0).to(tl.int64) * GROUPS_PER_PROGRAM + g
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for first in range(0, GROUP_ROWS, BLOCK_ROWS):
            rows = group * GROUP_ROWS + first + tl.arange(0, BLOCK_ROWS)
            mask = (rows[:, None] < R) & (cols[None, :] < N)
            acc += tl.sum(tl.load(in_ptr + rows[:, None] * N + cols[None, :], mask=mask, other=0.0), axis=0)
        if group < OUT_ROWS:
            tl.store(out_ptr + group * N + cols, acc.to(out_ptr.dtype.element_ty), mask=cols < N)


def row_group_schedule(device: torch.device, groups: int) -> int:
    """The schedule of the row groups, never their tree: one group per program on a GPU (M / 64
    programs: many at training's token counts), all of them in one program in the interpreter,
    whose cost is per program."""
    return 1 if tile_device(device.type) == "cuda" else max(1, groups)


def _sum_levels(partial: torch.Tensor, dw: torch.Tensor, block_rows: int, block_n: int, schedule: int | None):
    """Reduce the fp32 group sums ``partial`` [G, N] to ``dw`` [N]: GROUP_ROWS rows per node, level
    by level (G rows, then ceil(G / 64), ...), the last level written in dw's dtype."""
    n = dw.shape[0]
    sum_block = min(block_n, 1024)
    rows = partial.shape[0]
    while True:
        out_rows = triton.cdiv(rows, GROUP_ROWS)
        out = dw.view(1, n) if out_rows == 1 else torch.empty((out_rows, n), device=dw.device, dtype=torch.float32)
        per_program = schedule or row_group_schedule(dw.device, out_rows)
        launch(_sum_row_groups_kernel, (triton.cdiv(out_rows, per_program), triton.cdiv(n, sum_block)), dw.device,
               partial, out, rows, n, out_rows, per_program,
               BLOCK_ROWS=block_rows, BLOCK_N=sum_block, GROUP_ROWS=GROUP_ROWS)
        if out_rows == 1:
            return
        partial, rows = out, out_rows


def rms_norm_backward(x: torch.Tensor, weight: torch.Tensor, eps: float, grad_out: torch.Tensor,
                      weight_grad: bool = True, groups_per_program: int | None = None):
    """(d x, d weight or None) of ``rms_norm(x, weight, eps)`` for the output gradient ``grad_out``.
    ``groups_per_program`` forces the schedule (tests); it never changes the bits."""
    if groups_per_program is not None and groups_per_program < 1:
        raise InvalidArgumentError(f"rms_norm_backward: groups_per_program must be >= 1, got {groups_per_program}")
    n = x.shape[-1]
    x2 = reduction_rows(x.reshape(-1, n))
    dy2 = reduction_rows(grad_out.reshape(-1, n))
    m = x2.shape[0]
    dx = torch.empty(x2.shape, device=x.device, dtype=x.dtype)
    block_rows, block_n, num_warps = _launch_params(x.device, n)
    groups = triton.cdiv(m, GROUP_ROWS)
    per_program = groups_per_program or row_group_schedule(x.device, groups)
    partial = torch.empty((groups, n) if weight_grad else (1, 1), device=x.device, dtype=torch.float32)
    if m:
        launch(_rms_norm_backward_kernel, (triton.cdiv(groups, per_program),), x.device, x2, weight, dy2, dx, partial,
               x2.stride(0), dy2.stride(0), dx.stride(0), m, n, eps, groups, per_program,
               BLOCK_ROWS=block_rows, BLOCK_N=block_n, WEIGHT_GRAD=weight_grad, GROUP_ROWS=GROUP_ROWS,
               num_warps=num_warps)
    dw = None
    if weight_grad:
        dw = torch.zeros_like(weight) if m == 0 else torch.empty_like(weight)
        if m:
            _sum_levels(partial, dw, block_rows, block_n, groups_per_program)
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
