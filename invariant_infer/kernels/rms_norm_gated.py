"""The gated RMSNorm of Gated DeltaNet's output: each row normed on its own, then gated by silu(z).

Arithmetic follows Hugging Face's ``Qwen3_5RMSNormGated`` (and Qwen3-Next's): fp32 x * rsqrt(mean(x^2)
+ eps), rounded to the input dtype, times the weight (rounded to the input dtype), then times
silu(z) in fp32, rounded once more. One row per reduction, one block shape per row width.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .errors import InvalidArgumentError
from .launch import launch, reduction_rows
from .rms_norm import _launch_params, _row_rstd


@triton.jit(do_not_specialize=["M"])
def _rms_norm_gated_kernel(x_ptr, z_ptr, w_ptr, y_ptr, stride_x, stride_z, stride_y, M, N, eps,
                           BLOCK_ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + rows[:, None] * stride_z + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    normed = (x * _row_rstd(x, N, eps)[:, None]).to(y_ptr.dtype.element_ty).to(tl.float32)
    scaled = (w[None, :] * normed).to(y_ptr.dtype.element_ty).to(tl.float32)
    y = scaled * (z / (1.0 + tl.exp(-z)))
    tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


def rms_norm_gated(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x over its last dim, times the weight, times silu(z); in x's dtype."""
    n = x.shape[-1]
    if weight.shape != (n,) or z.shape != x.shape:
        raise InvalidArgumentError(f"rms_norm_gated: x {tuple(x.shape)}, z {tuple(z.shape)}, weight "
                                   f"{tuple(weight.shape)}")
    x2, z2 = reduction_rows(x.reshape(-1, n)), z.reshape(-1, n)
    z2 = z2 if z2.stride(-1) == 1 else z2.contiguous()
    m = x2.shape[0]
    y = torch.empty(x2.shape, device=x.device, dtype=x.dtype)
    block_rows, block_n, num_warps = _launch_params(x.device, n)
    if m:
        launch(_rms_norm_gated_kernel, (triton.cdiv(m, block_rows),), x.device, x2, z2, weight, y, x2.stride(0),
               z2.stride(0), y.stride(0), m, n, eps, BLOCK_ROWS=block_rows, BLOCK_N=block_n, num_warps=num_warps)
    return y.reshape(x.shape)
