"""gpt-oss's expert activation as a kernel: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g),
with g = min(gate, limit).

Elementwise, so invariant in principle; a kernel so every element runs the same code wherever it
sits in the batch (torch's CPU kernels split vectorized bodies from scalar tails, and a sigmoid
rounds differently in the two). Computed in fp32 and rounded once to the inputs' dtype. gate and
up may be strided views, as the interleaved halves of an expert's gate_up output are
(``gate_up[:, 0::2]``, ``gate_up[:, 1::2]``). Forward only: mixture-of-experts layers do not train.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .errors import InvalidArgumentError
from .launch import launch
from .configs import tile_device


@triton.jit(do_not_specialize=["M"])
def _clamped_swiglu_kernel(g_ptr, u_ptr, y_ptr, stride_gm, stride_gn, stride_um, stride_un, stride_y, M, N,
                           alpha, limit, BLOCK_ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    g = tl.load(g_ptr + rows[:, None] * stride_gm + cols[None, :] * stride_gn, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + rows[:, None] * stride_um + cols[None, :] * stride_un, mask=mask, other=0.0).to(tl.float32)
    g = tl.minimum(g, limit)
    u = tl.minimum(tl.maximum(u, -limit), limit)
    y = (u + 1.0) * (g * tl.sigmoid(g * alpha))
    tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """[M, N] gate and up (any strides) -> contiguous [M, N] in their dtype."""
    if gate.dim() != 2 or gate.shape != up.shape or gate.dtype != up.dtype:
        raise InvalidArgumentError(f"clamped_swiglu: gate {tuple(gate.shape)} {gate.dtype} vs up {tuple(up.shape)} "
                                   f"{up.dtype}; expected two [M, N] tensors of one dtype")
    m, n = gate.shape
    y = torch.empty((m, n), device=gate.device, dtype=gate.dtype)
    # Few, large programs for the interpreter; one row per program on GPU.
    block_rows, block_n = (16, min(triton.next_power_of_2(n), 4096)) if tile_device(gate.device.type) == "cpu" else \
        (1, min(triton.next_power_of_2(n), 1024))
    if m and n:
        launch(_clamped_swiglu_kernel, (triton.cdiv(m, block_rows), triton.cdiv(n, block_n)), gate.device,
               gate, up, y, *gate.stride(), *up.stride(), y.stride(0), m, n, float(alpha), float(limit),
               BLOCK_ROWS=block_rows, BLOCK_N=block_n)
    return y
