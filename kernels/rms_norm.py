"""Batch-invariant RMSNorm: one program per row, one block size per hidden size.

Arithmetic follows Hugging Face's Qwen2RMSNorm: upcast to fp32, x * rsqrt(mean(x^2) + eps),
cast back to the input dtype, then multiply by the weight (rounded to the output dtype).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import launch


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, stride_x, stride_y, N, eps, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_N)
    mask = offs < N
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    mean_sq = tl.sum(x * x, axis=0) / N
    normed = (x * (1.0 / tl.sqrt(mean_sq + eps))).to(x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    y = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(y_ptr + row * stride_y + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim; output dtype follows torch promotion of (weight, x)."""
    n = x.shape[-1]
    if weight.shape != (n,):
        raise ValueError(f"rms_norm: weight shape {tuple(weight.shape)} does not match hidden size {n}")
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    y = torch.empty(x2.shape, device=x.device, dtype=out_dtype)
    if x2.shape[0]:
        launch(_rms_norm_kernel, (x2.shape[0],), x.device, x2, weight, y, x2.stride(0), y.stride(0), n, eps,
               BLOCK_N=triton.next_power_of_2(n), num_warps=4 if n <= 4096 else 8)
    return y.reshape(x.shape[:-1] + (n,))
