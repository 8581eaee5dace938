"""silu(gate) * up for the Qwen2 MLP, as a kernel.

Elementwise, so invariant in principle; written as a kernel anyway so every element runs
the same code wherever it sits in the batch (torch's CPU kernels split vectorized bodies
from scalar tails, and the tail moves with the batch shape).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import launch
from .configs import tile_device
from .errors import InvalidArgumentError


@triton.jit
def rounded_silu(g, dtype: tl.constexpr):
    """silu(g) for fp32 g, rounded to ``dtype`` and back to fp32: the factor the forward, its fused
    prologue and the backward all multiply ``up`` by, so they share one formula."""
    return (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)


@triton.jit(do_not_specialize=["M"])
def _silu_mul_kernel(g_ptr, u_ptr, y_ptr, stride_g, stride_u, stride_y, M, N,
                     BLOCK_ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    g = tl.load(g_ptr + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + rows[:, None] * stride_u + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    # Round silu(g) to the model dtype before the product, as torch's two separate ops do.
    act = rounded_silu(g, y_ptr.dtype.element_ty)
    tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], (act * u).to(y_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise InvalidArgumentError(f"silu_mul: gate {tuple(gate.shape)} {gate.dtype} vs up {tuple(up.shape)} "
                                   f"{up.dtype}")
    n = gate.shape[-1]
    g2, u2 = gate.reshape(-1, n), up.reshape(-1, n)
    if g2.stride(-1) != 1:
        g2 = g2.contiguous()
    if u2.stride(-1) != 1:
        u2 = u2.contiguous()
    m = g2.shape[0]
    y = torch.empty(g2.shape, device=gate.device, dtype=gate.dtype)
    if tile_device(gate.device.type) == "cpu":  # few, large programs for the interpreter
        block_rows, block_n = 16, min(triton.next_power_of_2(n), 4096)
    else:
        block_rows, block_n = 1, min(triton.next_power_of_2(n), 1024)
    if m:
        launch(_silu_mul_kernel, (triton.cdiv(m, block_rows), triton.cdiv(n, block_n)), gate.device,
               g2, u2, y, g2.stride(0), u2.stride(0), y.stride(0), m, n, BLOCK_ROWS=block_rows, BLOCK_N=block_n)
    return y.reshape(gate.shape)
