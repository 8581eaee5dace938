"""Dynamic per-token activation quantization, symmetric, to fp8 e4m3 or int8.

Each row (or each group of ``group_size`` features within a row, for block formats) gets its own
scale, ``amax(|x|) / qmax``, so a row's quantized values depend on that row alone, never on the
other tokens of the batch (a per-tensor dynamic scale would: the max over every token).

The arithmetic follows compressed-tensors' dynamic quantization step for step, so the values
are the ones its fake-quantized forward uses: ``qmax`` is half the integer range (127.5 for
int8, 448 for fp8 e4m3); the scale and ``x / scale`` are rounded to the activation dtype; a
zero scale becomes that dtype's epsilon; then clamp and round (to nearest even) to the target.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fp8_support import check_fp8_device
from .launch import launch
from .errors import InvalidArgumentError, InvalidDtypeError

FP8_MAX = 448.0
INT8_MIN, INT8_MAX = -128.0, 127.0
# compressed-tensors' scale divisor: (q_max - q_min) / 2.
QMAX = {torch.float8_e4m3fn: FP8_MAX, torch.int8: (INT8_MAX - INT8_MIN) / 2}
ACTIVATION_DTYPES = (torch.bfloat16, torch.float16)


@triton.jit
def round_half_even(v):
    """Round fp32 to the nearest integer, ties to even (torch.round), from floor only."""
    r = tl.floor(v + 0.5)
    tie = (r - v) == 0.5
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where(tie & odd, r - 1.0, r)


@triton.jit(do_not_specialize=["rows"])
def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, rows, K, stride_x, stride_q, EPS,
                          GROUP: tl.constexpr, QMAX: tl.constexpr, IS_INT: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    offs = group * GROUP + tl.arange(0, GROUP)
    mask = offs < K
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    act = x_ptr.dtype.element_ty
    amax = tl.max(tl.abs(x.to(tl.float32)), axis=0)  # a max is exact in any order
    scale = (amax / QMAX).to(act).to(tl.float32)
    scale = tl.where(scale == 0.0, EPS, scale)
    scaled = (x.to(tl.float32) / scale).to(act).to(tl.float32)
    if IS_INT:
        q = round_half_even(tl.minimum(tl.maximum(scaled, -128.0), 127.0)).to(tl.int8)
    else:
        q = tl.minimum(tl.maximum(scaled, -QMAX), QMAX).to(tl.float8e4nv)
    tl.store(q_ptr + row * stride_q + offs, q, mask=mask)
    tl.store(scale_ptr + row * tl.cdiv(K, GROUP) + group, scale)


def quantize_activations(x: torch.Tensor, dtype: torch.dtype, group_size: int | None = None):
    """``(q, scale)`` for 2-D ``x`` [M, K] in bf16/fp16: ``q`` [M, K] in ``dtype`` (float8_e4m3fn
    or int8) and fp32 ``scale`` [M, ceil(K / group_size)] (one per row when ``group_size`` is
    None), with ``q * scale`` approximating ``x``. Each row's output depends on that row alone."""
    if dtype not in QMAX:
        raise InvalidDtypeError(f"quantize_activations: target dtype must be one of {list(QMAX)}, got {dtype}")
    if x.dim() != 2 or x.dtype not in ACTIVATION_DTYPES:
        raise InvalidDtypeError(f"quantize_activations takes 2-D {ACTIVATION_DTYPES} activations, got {x.dtype} "
                                f"{tuple(x.shape)}")
    if dtype == torch.float8_e4m3fn:
        check_fp8_device("quantize_activations", x.device)
    m, k = x.shape
    group = k if group_size is None else group_size
    block = triton.next_power_of_2(group)
    if group_size is not None and block != group:
        raise InvalidArgumentError(f"quantize_activations: group_size must be a power of two, got {group_size}")
    groups = triton.cdiv(k, group)
    if x.stride(-1) != 1:
        x = x.contiguous()
    q = torch.empty((m, k), device=x.device, dtype=dtype)
    scale = torch.empty((m, groups), device=x.device, dtype=torch.float32)
    if m:
        # Per-token rows of any width run as one group padded to a power of two (masked).
        launch(_quantize_rows_kernel, (m, groups), x.device, x, q, scale, m, k, x.stride(0), q.stride(0),
               torch.finfo(x.dtype).eps, GROUP=block if group_size is not None else triton.next_power_of_2(k),
               QMAX=QMAX[dtype], IS_INT=dtype == torch.int8)
    return q, scale
