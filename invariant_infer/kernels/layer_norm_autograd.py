"""LayerNorm with a backward: the forward is ``layer_norm``'s kernel, the backward one Triton kernel
plus ``rms_norm_autograd``'s fixed tree for the parameter gradients.

With n = (x - mean) * rstd (fp32, as the forward computes it) and y = n * weight + bias:
  * d x = rstd * (dn - mean(dn) - n * mean(dn * n)) with dn = dy * weight, each row reduced on its
    own in the forward's blocks, so a row's input gradient never depends on the other rows;
  * d weight = sum over rows of dy * n and d bias = sum over rows of dy, on the tree of
    ``rms_norm_autograd``: the flattened rows cut into groups of ``GROUP_ROWS`` from row 0, each group
    summed in row order (in slices of BLOCK_ROWS rows: 1 on a GPU), then the groups' fp32 sums
    cut into groups of ``GROUP_ROWS`` again, level after level, until one row is left. The tree is
    fixed by the row count alone: the same rows give the same bits run after run and whatever the
    schedule (groups per program). They are sums over the batch, so a batch's d weight is not any
    one sample's: batch invariance holds for d x, determinism for d weight and d bias.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .errors import InvalidArgumentError
from .launch import launch, reduction_rows
from .layer_norm import _centred_rows, launch_params, layer_norm
from .rms_norm_autograd import GROUP_ROWS, _sum_levels, row_group_schedule


@triton.jit(do_not_specialize=["M", "GROUPS", "GROUPS_PER_PROGRAM"])
def _layer_norm_backward_kernel(x_ptr, w_ptr, dy_ptr, dx_ptr, part_w_ptr, part_b_ptr, stride_x, stride_dy,
                                stride_dx, M, N, eps, GROUPS, GROUPS_PER_PROGRAM, BLOCK_ROWS: tl.constexpr,
                                BLOCK_N: tl.constexpr, PARAM_GRAD: tl.constexpr, GROUP_ROWS: tl.constexpr):
    """d x of every row of this program's groups; with PARAM_GRAD, each group's sums of dy * n and of
    dy (its BLOCK_ROWS-row slices added in row order) into row ``group`` of the fp32 partials."""
    cols = tl.arange(0, BLOCK_N)
    w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    for g in range(0, GROUPS_PER_PROGRAM):
        group = tl.program_id(0).to(tl.int64) * GROUPS_PER_PROGRAM + g
        acc_w = tl.zeros([BLOCK_N], dtype=tl.float32)
        acc_b = tl.zeros([BLOCK_N], dtype=tl.float32)
        for first in range(0, GROUP_ROWS, BLOCK_ROWS):
            rows = group * GROUP_ROWS + first + tl.arange(0, BLOCK_ROWS)
            mask = (rows[:, None] < M) & (cols[None, :] < N)
            x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            centred, rstd = _centred_rows(x, mask, N, eps)
            normed = centred * rstd[:, None]
            dn = dy * w[None, :]
            mean_dn = tl.sum(dn, axis=1) / N
            mean_dn_n = tl.sum(dn * normed, axis=1) / N
            dx = rstd[:, None] * (dn - mean_dn[:, None] - normed * mean_dn_n[:, None])
            tl.store(dx_ptr + rows[:, None] * stride_dx + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
            if PARAM_GRAD:  # rows past M load zeros and add nothing
                acc_w += tl.sum(dy * normed, axis=0)
                acc_b += tl.sum(dy, axis=0)
        if PARAM_GRAD and group < GROUPS:
            tl.store(part_w_ptr + group * N + cols, acc_w, mask=cols < N)
            tl.store(part_b_ptr + group * N + cols, acc_b, mask=cols < N)


def layer_norm_backward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
                        grad_out: torch.Tensor, weight_grad: bool = True, bias_grad: bool = True,
                        groups_per_program: int | None = None):
    """(d x, d weight or None, d bias or None) of ``layer_norm(x, weight, bias, eps)`` for ``grad_out``;
    no d bias without a bias. ``groups_per_program`` forces the schedule (tests); it never changes the bits."""
    if groups_per_program is not None and groups_per_program < 1:
        raise InvalidArgumentError(f"layer_norm_backward: groups_per_program must be >= 1, got {groups_per_program}")
    bias_grad = bias_grad and bias is not None
    n = x.shape[-1]
    x2 = reduction_rows(x.reshape(-1, n))
    dy2 = reduction_rows(grad_out.to(x.dtype).reshape(-1, n))
    m = x2.shape[0]
    dx = torch.empty(x2.shape, device=x.device, dtype=x.dtype)
    block_rows, block_n, num_warps = launch_params(x.device, n)
    groups = triton.cdiv(m, GROUP_ROWS)
    per_program = groups_per_program or row_group_schedule(x.device, groups)
    param_grad = weight_grad or bias_grad
    part_shape = (groups, n) if param_grad else (1, 1)
    part_w = torch.empty(part_shape, device=x.device, dtype=torch.float32)
    part_b = torch.empty(part_shape, device=x.device, dtype=torch.float32)
    if m:
        launch(_layer_norm_backward_kernel, (triton.cdiv(groups, per_program),), x.device, x2, weight, dy2, dx,
               part_w, part_b, x2.stride(0), dy2.stride(0), dx.stride(0), m, n, eps, groups, per_program,
               BLOCK_ROWS=block_rows, BLOCK_N=block_n, PARAM_GRAD=param_grad, GROUP_ROWS=GROUP_ROWS,
               num_warps=num_warps)
    grads = []
    for wanted, partial, param in ((weight_grad, part_w, weight), (bias_grad, part_b, bias)):
        if not wanted:
            grads.append(None)
            continue
        grad = torch.zeros_like(param) if m == 0 else torch.empty_like(param)
        if m:
            _sum_levels(partial, grad, block_rows, block_n, groups_per_program)
        grads.append(grad)
    return dx.reshape(x.shape), grads[0], grads[1]


class LayerNormFunction(torch.autograd.Function):
    """``layer_norm`` (bitwise its forward) with a batch-invariant d x and deterministic d weight, d bias."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
        ctx.save_for_backward(x, weight, bias)
        ctx.eps = eps
        return layer_norm(x, weight, bias, eps)

    @staticmethod
    @torch.autograd.function.once_differentiable  # no double backward: a clear error, not wrong grads
    def backward(ctx, grad_out: torch.Tensor):
        x, weight, bias = ctx.saved_tensors
        need = ctx.needs_input_grad
        dx, dw, db = layer_norm_backward(x, weight, bias, ctx.eps, grad_out, weight_grad=need[1],
                                         bias_grad=need[2])
        return dx, dw, db, None


def layer_norm_autograd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        eps: float) -> torch.Tensor:
    """Differentiable ``layer_norm``: same forward bits, batch-invariant d x, run-to-run identical d weight
    and d bias."""
    return LayerNormFunction.apply(x, weight, bias, eps)
