"""silu(gate) * up, row by row, for the Qwen2 MLP.

Written as a kernel (not torch ops) so that every element is computed by the same code
whatever its position in the batch: no vectorized-body vs scalar-tail split on CPU.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import launch


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, y_ptr, stride_g, stride_u, stride_y, N, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = offs < N
    g = tl.load(g_ptr + row * stride_g + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + offs, mask=mask, other=0.0).to(tl.float32)
    # Round silu(g) to the model dtype before the product, as torch's two separate ops do.
    act = (g / (1.0 + tl.exp(-g))).to(y_ptr.dtype.element_ty).to(tl.float32)
    tl.store(y_ptr + row * stride_y + offs, (act * u).to(y_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"silu_mul: gate {tuple(gate.shape)} {gate.dtype} vs up {tuple(up.shape)} {up.dtype}")
    n = gate.shape[-1]
    g2, u2 = gate.reshape(-1, n), up.reshape(-1, n)
    if g2.stride(-1) != 1:
        g2 = g2.contiguous()
    if u2.stride(-1) != 1:
        u2 = u2.contiguous()
    y = torch.empty(g2.shape, device=gate.device, dtype=gate.dtype)
    block_n = min(triton.next_power_of_2(n), 4096 if gate.device.type == "cpu" else 1024)
    if g2.shape[0]:
        launch(_silu_mul_kernel, (g2.shape[0], triton.cdiv(n, block_n)), gate.device,
               g2, u2, y, g2.stride(0), u2.stride(0), y.stride(0), n, BLOCK_N=block_n)
    return y.reshape(gate.shape)
