"""Batch-invariant L2 normalisation of rows: each row's sum of squares reduced on its own.

As ``torch.nn.functional.normalize(x, p=2, dim=-1)``: the row's norm sqrt(sum(x^2)) in fp32, rounded
to x's dtype (torch's norm returns x's dtype), clamped below by ``eps``, then x / norm in fp32,
rounded once. The sum over H runs in one block per hidden size (as RMSNorm), so a row's bits never
depend on its neighbours. Forward only.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .configs import tile_device
from .errors import InvalidDtypeError, UnsupportedOperationError
from .launch import launch, reduction_rows


@triton.jit(do_not_specialize=["M"])
def _l2_normalize_kernel(x_ptr, y_ptr, M, N, eps, BLOCK_ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    x = tl.load(x_ptr + rows[:, None] * N + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    norm = tl.sqrt(tl.sum(x * x, axis=1)).to(y_ptr.dtype.element_ty).to(tl.float32)
    y = x / tl.maximum(norm, eps)[:, None]
    tl.store(y_ptr + rows[:, None] * N + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


def l2_normalize(x: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """x / max(||x||_2, eps) over the last dim, in x's dtype."""
    if not x.dtype.is_floating_point:
        raise InvalidDtypeError(f"l2_normalize: x must be floating point, got {x.dtype}")
    if x.requires_grad and torch.is_grad_enabled():
        raise UnsupportedOperationError("l2_normalize has no backward: call it under torch.no_grad() or "
                                        "torch.inference_mode()")
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    m = x2.shape[0]
    y = torch.empty(x2.shape, device=x.device, dtype=x.dtype)
    if m and n:
        x2 = reduction_rows(x2)
        block_rows = 16 if tile_device(x.device.type) == "cpu" else 1  # the interpreter pays per program
        block_n = triton.next_power_of_2(n)
        launch(_l2_normalize_kernel, (triton.cdiv(m, block_rows),), x.device, x2, y, m, n, eps,
               BLOCK_ROWS=block_rows, BLOCK_N=block_n, num_warps=4 if block_n <= 4096 else 8)
    return y.reshape(x.shape)
