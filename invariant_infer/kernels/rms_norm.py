"""Batch-invariant RMSNorm: each row reduced on its own, one block shape per hidden size.

Arithmetic follows Hugging Face's Qwen2RMSNorm: upcast to fp32, x * rsqrt(mean(x^2) + eps),
cast back to the input dtype, then multiply by the weight (rounded to the output dtype). With
``zero_centred`` it follows the zero-centred norms of Qwen3.5 and Qwen3-Next instead: the fp32
normed row times (1 + weight) in fp32, rounded once to the input dtype; with ``scale_in_fp32``
gpt-oss's: the fp32 normed row times the weight in fp32, rounded once to the input dtype.
A program may hold several rows (BLOCK_ROWS, fixed per device and hidden size), but the sum
runs along each row separately, so a row's bits never depend on its neighbours.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import launch, reduction_rows
from .configs import tile_device
from .errors import InvalidArgumentError


@triton.jit
def _row_rstd(x, N, eps):
    """1 / sqrt(mean(x^2) + eps) per row of an fp32 [rows, BLOCK_N] block."""
    return 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / N + eps)


@triton.jit(do_not_specialize=["M"])
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, stride_x, stride_y, M, N, eps,
                     BLOCK_ROWS: tl.constexpr, BLOCK_N: tl.constexpr, ZERO_CENTRED: tl.constexpr = False,
                     SCALE_IN_FP32: tl.constexpr = False):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < N, other=0.0)
    if ZERO_CENTRED:
        y = x * _row_rstd(x, N, eps)[:, None] * (1.0 + w.to(tl.float32))[None, :]
    elif SCALE_IN_FP32:
        y = x * _row_rstd(x, N, eps)[:, None] * w.to(tl.float32)[None, :]
    else:
        normed = (x * _row_rstd(x, N, eps)[:, None]).to(x_ptr.dtype.element_ty)
        y = w.to(tl.float32)[None, :] * normed.to(tl.float32)
    tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


def _launch_params(device: torch.device, n: int):
    """(BLOCK_ROWS, BLOCK_N, num_warps): fixed per device and hidden size. The interpreter pays per
    program, so it takes 16 rows at a time; on GPU one row per program."""
    block_n = triton.next_power_of_2(n)
    return (16 if tile_device(device.type) == "cpu" else 1), block_n, (4 if block_n <= 4096 else 8)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centred: bool = False,
             scale_in_fp32: bool = False) -> torch.Tensor:
    """RMSNorm over the last dim; output dtype follows torch promotion of (weight, x), as in HF
    (``zero_centred``: x's dtype, scaled by 1 + weight, as Qwen3.5's norms; ``scale_in_fp32``: x's
    dtype, scaled by the weight in fp32, as gpt-oss's)."""
    n = x.shape[-1]
    if weight.shape != (n,):
        raise InvalidArgumentError(f"rms_norm: weight shape {tuple(weight.shape)} does not match hidden size {n}")
    x2 = reduction_rows(x.reshape(-1, n))
    m = x2.shape[0]
    dtype = x.dtype if zero_centred or scale_in_fp32 else torch.promote_types(weight.dtype, x.dtype)
    y = torch.empty(x2.shape, device=x.device, dtype=dtype)
    block_rows, block_n, num_warps = _launch_params(x.device, n)
    if m:
        launch(_rms_norm_kernel, (triton.cdiv(m, block_rows),), x.device, x2, weight, y, x2.stride(0), y.stride(0),
               m, n, eps, BLOCK_ROWS=block_rows, BLOCK_N=block_n, ZERO_CENTRED=zero_centred,
               SCALE_IN_FP32=scale_in_fp32, num_warps=num_warps)
    return y.reshape(x.shape[:-1] + (n,))
