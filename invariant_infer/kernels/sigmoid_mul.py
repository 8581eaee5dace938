"""x * sigmoid(gate) (the output gate of Qwen3.5's and Qwen3-Next's attention), as a kernel.

Elementwise, so invariant in principle; a kernel so that every element runs the same code wherever
it sits in the batch (torch's CPU kernels split vectorized bodies from scalar tails, and the tail
moves with the batch shape). sigmoid(gate) is rounded to the dtype before the product, as torch's
two separate ops do.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .errors import InvalidArgumentError
from .launch import launch
from .configs import tile_device


@triton.jit(do_not_specialize=["M"])
def _sigmoid_mul_kernel(x_ptr, g_ptr, y_ptr, stride_x, stride_g, stride_y, M, N,
                        BLOCK_ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    gate = (1.0 / (1.0 + tl.exp(-g))).to(y_ptr.dtype.element_ty).to(tl.float32)
    tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], (x * gate).to(y_ptr.dtype.element_ty), mask=mask)


def sigmoid_mul(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    if x.shape != gate.shape or x.dtype != gate.dtype:
        raise InvalidArgumentError(f"sigmoid_mul: x {tuple(x.shape)} {x.dtype} vs gate {tuple(gate.shape)} "
                                   f"{gate.dtype}")
    n = x.shape[-1]
    x2, g2 = x.reshape(-1, n), gate.reshape(-1, n)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    g2 = g2 if g2.stride(-1) == 1 else g2.contiguous()
    m = x2.shape[0]
    y = torch.empty(x2.shape, device=x.device, dtype=x.dtype)
    if tile_device(x.device.type) == "cpu":  # few, large programs for the interpreter
        block_rows, block_n = 16, min(triton.next_power_of_2(n), 4096)
    else:
        block_rows, block_n = 1, min(triton.next_power_of_2(n), 1024)
    if m:
        launch(_sigmoid_mul_kernel, (triton.cdiv(m, block_rows), triton.cdiv(n, block_n)), x.device,
               x2, g2, y, x2.stride(0), g2.stride(0), y.stride(0), m, n, BLOCK_ROWS=block_rows, BLOCK_N=block_n)
    return y.reshape(x.shape)
