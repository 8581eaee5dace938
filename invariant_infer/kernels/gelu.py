"""gelu(x) with erf (torch's default ``nn.GELU``; the Qwen-VL patch mergers, BERT) as a kernel, and its
tanh form (``gelu_pytorch_tanh``: Qwen3-VL's vision MLP, ``gelu_new`` encoders), each with its backward.

Elementwise, so invariant in principle; a kernel so every element runs the same code wherever it
sits in the batch (torch's CPU kernels split vectorized bodies from scalar tails, and the tail
moves with the batch shape). As torch: 0.5 x (1 + erf(x / sqrt(2))) in fp32, rounded once to the
dtype (the tanh form as ``gelu_tanh_mul`` computes it). The backward computes each element's
gradient from that element alone.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .errors import InvalidArgumentError
from .gelu_tanh_mul import _gelu_tanh_parts, _gelu_tanh_slope, elementwise, elementwise_backward


@triton.jit(do_not_specialize=["M"])
def _gelu_kernel(x_ptr, y_ptr, stride_x, stride_y, M, N, BLOCK_ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                 TANH: tl.constexpr = False):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    # Literals: a kernel cannot read a plain global when compiled for a GPU. 1 / sqrt(2).
    if TANH:
        y = _gelu_tanh_parts(x)[0]
    else:
        y = 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
    tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M"])
def _gelu_backward_kernel(x_ptr, dy_ptr, dx_ptr, stride_x, stride_dy, stride_dx, M, N,
                          BLOCK_ROWS: tl.constexpr, BLOCK_N: tl.constexpr, TANH: tl.constexpr = False):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if TANH:  # as gelu_tanh_mul's backward computes d gate
        slope = _gelu_tanh_slope(x, _gelu_tanh_parts(x)[1])
    else:  # d/dx: Phi(x) + x phi(x); 1 / sqrt(2 pi) = 0.3989422804014327.
        slope = 0.5 * (1.0 + tl.math.erf(x * 0.7071067811865476)) + x * 0.3989422804014327 * tl.exp(-0.5 * x * x)
    tl.store(dx_ptr + rows[:, None] * stride_dx + cols[None, :], (dy * slope).to(dx_ptr.dtype.element_ty), mask=mask)


def _check_form(approximate: str) -> None:
    if approximate not in ("none", "tanh"):
        raise InvalidArgumentError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")


def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """gelu(x), elementwise, in x's dtype: the erf form, or with ``approximate="tanh"`` the tanh form."""
    _check_form(approximate)
    return elementwise(_gelu_kernel, x, TANH=approximate == "tanh")


def gelu_backward(x: torch.Tensor, grad_out: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """d x of ``gelu(x, approximate)`` for the output gradient ``grad_out``."""
    _check_form(approximate)
    return elementwise_backward(_gelu_backward_kernel, x, grad_out, TANH=approximate == "tanh")


class GeluFunction(torch.autograd.Function):
    """``gelu`` (bitwise its forward, either form) with the batch-invariant elementwise backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.approximate = approximate
        return gelu(x, approximate)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (x,) = ctx.saved_tensors
        return gelu_backward(x, grad_out, ctx.approximate), None


def gelu_autograd(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """Differentiable ``gelu`` (erf or ``approximate="tanh"`` form): same forward bits, batch-invariant,
    deterministic gradients."""
    _check_form(approximate)
    return GeluFunction.apply(x, approximate)
