"""Batch-invariant LayerNorm (Qwen3-VL's vision tower, BERT): each row reduced on its own (the backward:
``layer_norm_autograd``).

As torch's ``nn.LayerNorm``: in fp32, the row's mean, then the mean of its squared deviations,
(x - mean) / sqrt(var + eps) * weight + bias (no bias: the add skipped), rounded once to the input
dtype. A program may hold several rows (BLOCK_ROWS, fixed per device), but every sum runs along one
row, so a row's bits never depend on its neighbours.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .errors import InvalidArgumentError
from .launch import launch
from .configs import tile_device


@triton.jit
def _centred_rows(x, mask, N, eps):
    """(x - mean, 1 / sqrt(var + eps)) per row of an fp32 [rows, BLOCK_N] block (0 outside ``mask``);
    the forward and the backward both call this, so they normalize with the same bits."""
    mean = tl.sum(x, axis=1) / N
    centred = tl.where(mask, x - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=1) / N + eps)
    return centred, rstd


@triton.jit(do_not_specialize=["M"])
def _layer_norm_kernel(x_ptr, w_ptr, b_ptr, y_ptr, stride_x, stride_y, M, N, eps,
                       BLOCK_ROWS: tl.constexpr, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr = True):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    centred, rstd = _centred_rows(x, mask, N, eps)
    w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    y = centred * rstd[:, None] * w[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


def launch_params(device: torch.device, n: int) -> tuple[int, int, int]:
    """(BLOCK_ROWS, BLOCK_N, num_warps): fixed per device and hidden size; the interpreter pays per
    program, so it takes 16 rows at a time, a GPU one."""
    block_n = triton.next_power_of_2(n)
    return (16 if tile_device(device.type) == "cpu" else 1), block_n, (4 if block_n <= 4096 else 8)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """LayerNorm over the last dim with an affine weight and (unless None) bias, in x's dtype."""
    n = x.shape[-1]
    if weight.shape != (n,) or (bias is not None and bias.shape != (n,)):
        shape = None if bias is None else tuple(bias.shape)
        raise InvalidArgumentError(f"layer_norm: weight {tuple(weight.shape)} / bias {shape} do not match "
                                   f"hidden size {n}")
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = torch.empty(x2.shape, device=x.device, dtype=x.dtype)
    block_rows, block_n, num_warps = launch_params(x.device, n)
    if m:
        launch(_layer_norm_kernel, (triton.cdiv(m, block_rows),), x.device, x2, weight,
               weight if bias is None else bias, y, x2.stride(0), y.stride(0), m, n, eps,
               BLOCK_ROWS=block_rows, BLOCK_N=block_n, HAS_BIAS=bias is not None, num_warps=num_warps)
    return y.reshape(x.shape)
