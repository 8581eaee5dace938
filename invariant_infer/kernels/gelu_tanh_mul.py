"""gelu_tanh(gate) * up (Gemma's MLP: ``gelu_pytorch_tanh``) as a kernel, with its backward.

Elementwise, so invariant in principle; a kernel so every element runs the same code wherever it
sits in the batch (torch's CPU kernels split vectorized bodies from scalar tails, and the tail
moves with the batch shape). As torch's two ops: gelu_tanh(g) in fp32, rounded to the dtype, times
up, rounded. The backward computes each element's gradients from that element alone.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .errors import InvalidArgumentError
from .launch import launch
from .configs import tile_device



@triton.jit
def _tanh(x):
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)  # exp overflow to inf gives 1; underflow to 0 gives -1


@triton.jit
def _gelu_tanh_parts(g):
    """(gelu_tanh(g), tanh of its inner term) for fp32 g."""
    # Literals: a kernel cannot read a plain global when compiled for a GPU. sqrt(2 / pi), 0.044715.
    t = _tanh(0.7978845608028654 * (g + 0.044715 * g * g * g))
    return 0.5 * g * (1.0 + t), t


@triton.jit
def _gelu_tanh_slope(g, t):
    """d gelu_tanh / d g for fp32 g and t, the tanh of its inner term (``_gelu_tanh_parts``)."""
    return 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * g * g)


@triton.jit(do_not_specialize=["M"])
def _gelu_tanh_mul_kernel(g_ptr, u_ptr, y_ptr, stride_g, stride_u, stride_y, M, N,
                          BLOCK_ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    g = tl.load(g_ptr + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + rows[:, None] * stride_u + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    act = _gelu_tanh_parts(g)[0].to(y_ptr.dtype.element_ty).to(tl.float32)
    tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], (act * u).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M"])
def _gelu_tanh_mul_backward_kernel(g_ptr, u_ptr, dy_ptr, dg_ptr, du_ptr, stride_g, stride_u, stride_dy, stride_d,
                                   M, N, BLOCK_ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    g = tl.load(g_ptr + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + rows[:, None] * stride_u + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    act, t = _gelu_tanh_parts(g)
    slope = _gelu_tanh_slope(g, t)
    offsets = rows[:, None] * stride_d + cols[None, :]
    tl.store(dg_ptr + offsets, (dy * u * slope).to(dg_ptr.dtype.element_ty), mask=mask)
    # d(up) uses the factor the forward multiplied by: gelu_tanh(g) rounded to the dtype.
    rounded = act.to(du_ptr.dtype.element_ty).to(tl.float32)
    tl.store(du_ptr + offsets, (dy * rounded).to(du_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    t2 = t.reshape(-1, n)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _blocks(device: torch.device, n: int) -> tuple[int, int]:
    if tile_device(device.type) == "cpu":  # few, large programs for the interpreter
        return 16, min(triton.next_power_of_2(n), 4096)
    return 1, min(triton.next_power_of_2(n), 1024)


def elementwise(kernel, x: torch.Tensor, **constexprs) -> torch.Tensor:
    """``kernel(x_ptr, y_ptr, stride_x, stride_y, M, N, BLOCK_ROWS, BLOCK_N, **constexprs)`` over x's rows of
    its last dimension: y in x's shape and dtype."""
    n = x.shape[-1]
    x2 = _rows(x, n)
    m = x2.shape[0]
    y = torch.empty(x2.shape, device=x.device, dtype=x.dtype)
    block_rows, block_n = _blocks(x.device, n)
    if m:
        launch(kernel, (triton.cdiv(m, block_rows), triton.cdiv(n, block_n)), x.device,
               x2, y, x2.stride(0), y.stride(0), m, n, BLOCK_ROWS=block_rows, BLOCK_N=block_n, **constexprs)
    return y.reshape(x.shape)


def elementwise_backward(kernel, x: torch.Tensor, grad_out: torch.Tensor, **constexprs) -> torch.Tensor:
    """``kernel(x_ptr, dy_ptr, dx_ptr, stride_x, stride_dy, stride_dx, M, N, BLOCK_ROWS, BLOCK_N, **constexprs)``
    over x's rows, with ``elementwise``'s blocks: d x in x's shape and dtype."""
    n = x.shape[-1]
    x2, dy2 = _rows(x, n), _rows(grad_out.to(x.dtype), n)
    m = x2.shape[0]
    dx = torch.empty(x2.shape, device=x.device, dtype=x.dtype)
    block_rows, block_n = _blocks(x.device, n)
    if m:
        launch(kernel, (triton.cdiv(m, block_rows), triton.cdiv(n, block_n)), x.device, x2, dy2, dx,
               x2.stride(0), dy2.stride(0), dx.stride(0), m, n, BLOCK_ROWS=block_rows, BLOCK_N=block_n, **constexprs)
    return dx.reshape(x.shape)


def gelu_tanh_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gelu(gate, approximate="tanh") * up, elementwise, in the inputs' dtype."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise InvalidArgumentError(f"gelu_tanh_mul: gate {tuple(gate.shape)} {gate.dtype} vs up {tuple(up.shape)} "
                                   f"{up.dtype}")
    n = gate.shape[-1]
    g2, u2 = _rows(gate, n), _rows(up, n)
    m = g2.shape[0]
    y = torch.empty(g2.shape, device=gate.device, dtype=gate.dtype)
    block_rows, block_n = _blocks(gate.device, n)
    if m:
        launch(_gelu_tanh_mul_kernel, (triton.cdiv(m, block_rows), triton.cdiv(n, block_n)), gate.device,
               g2, u2, y, g2.stride(0), u2.stride(0), y.stride(0), m, n, BLOCK_ROWS=block_rows, BLOCK_N=block_n)
    return y.reshape(gate.shape)


def gelu_tanh_mul_backward(gate: torch.Tensor, up: torch.Tensor, grad_out: torch.Tensor):
    """(d gate, d up) of ``gelu_tanh_mul(gate, up)`` for the output gradient ``grad_out``."""
    n = gate.shape[-1]
    g2, u2, dy2 = _rows(gate, n), _rows(up, n), _rows(grad_out.to(gate.dtype), n)
    m = g2.shape[0]
    dg = torch.empty(g2.shape, device=gate.device, dtype=gate.dtype)
    du = torch.empty_like(dg)
    block_rows, block_n = _blocks(gate.device, n)
    if m:
        launch(_gelu_tanh_mul_backward_kernel, (triton.cdiv(m, block_rows), triton.cdiv(n, block_n)), gate.device,
               g2, u2, dy2, dg, du, g2.stride(0), u2.stride(0), dy2.stride(0), dg.stride(0), m, n,
               BLOCK_ROWS=block_rows, BLOCK_N=block_n)
    return dg.reshape(gate.shape), du.reshape(gate.shape)


class GeluTanhMulFunction(torch.autograd.Function):
    """``gelu_tanh_mul`` (bitwise its forward) with the batch-invariant elementwise backward."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return gelu_tanh_mul(gate, up)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        gate, up = ctx.saved_tensors
        return gelu_tanh_mul_backward(gate, up, grad_out)


def gelu_tanh_mul_autograd(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Differentiable ``gelu_tanh_mul``: same forward bits, batch-invariant, deterministic gradients."""
    return GeluTanhMulFunction.apply(gate, up)
