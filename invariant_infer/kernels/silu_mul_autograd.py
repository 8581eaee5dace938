"""silu(gate) * up with a backward: the forward is ``silu_mul``'s kernel, the backward an elementwise kernel.

Every element's gradient is computed from that element alone (fp32 arithmetic, one rounding to the
dtype at the end), so a row's gradients never depend on the other rows, and the same inputs give
the same bits every time.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import launch
from .configs import tile_device
from .silu_mul import rounded_silu, silu_mul


@triton.jit(do_not_specialize=["M"])
def _silu_mul_backward_kernel(g_ptr, u_ptr, dy_ptr, dg_ptr, du_ptr, stride_g, stride_u, stride_dy, stride_d, M, N,
                              BLOCK_ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    g = tl.load(g_ptr + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + rows[:, None] * stride_u + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-g))
    # The forward multiplies up by silu(g) rounded to the dtype: d(up) uses that same factor,
    # computed as the forward computes it.
    act = rounded_silu(g, dg_ptr.dtype.element_ty)
    dg = dy * u * (sig * (1.0 + g * (1.0 - sig)))
    offsets = rows[:, None] * stride_d + cols[None, :]
    tl.store(dg_ptr + offsets, dg.to(dg_ptr.dtype.element_ty), mask=mask)
    tl.store(du_ptr + offsets, (dy * act).to(du_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    t2 = t.reshape(-1, n)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def silu_mul_backward(gate: torch.Tensor, up: torch.Tensor, grad_out: torch.Tensor):
    """(d gate, d up) of ``silu_mul(gate, up)`` for the output gradient ``grad_out``."""
    n = gate.shape[-1]
    g2, u2, dy2 = _rows(gate, n), _rows(up, n), _rows(grad_out.to(gate.dtype), n)
    m = g2.shape[0]
    dg = torch.empty(g2.shape, device=gate.device, dtype=gate.dtype)
    du = torch.empty_like(dg)
    if tile_device(gate.device.type) == "cpu":  # the forward's blocks: few, large programs for the interpreter
        block_rows, block_n = 16, min(triton.next_power_of_2(n), 4096)
    else:
        block_rows, block_n = 1, min(triton.next_power_of_2(n), 1024)
    if m:
        launch(_silu_mul_backward_kernel, (triton.cdiv(m, block_rows), triton.cdiv(n, block_n)), gate.device,
               g2, u2, dy2, dg, du, g2.stride(0), u2.stride(0), dy2.stride(0), dg.stride(0), m, n,
               BLOCK_ROWS=block_rows, BLOCK_N=block_n)
    return dg.reshape(gate.shape), du.reshape(gate.shape)


class SiluMulFunction(torch.autograd.Function):
    """``silu_mul`` (bitwise its forward) with the batch-invariant elementwise backward."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return silu_mul(gate, up)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        gate, up = ctx.saved_tensors
        return silu_mul_backward(gate, up, grad_out)


def silu_mul_autograd(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Differentiable ``silu_mul``: same forward bits, batch-invariant, deterministic gradients."""
    return SiluMulFunction.apply(gate, up)
