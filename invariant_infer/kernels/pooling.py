"""Batch-invariant pooling of token states: a row's mean (or weighted mean) over its own real tokens.

``pool_tokens(x, start, end, weighted, divisor)`` reduces ``x`` [B, L, H] over tokens
``start[b] .. end[b] - 1`` of row b (the contiguous ones of its attention mask, on either padding side).
The tokens are summed in fp32 in blocks of ``BLOCK_T`` tokens counted from the row's first real token,
each block summed on its own and the block sums added in block order, with positions past ``end``
loaded as zeros. That tree is a function of the row's length alone: neither the batch, the padding
amount or side, nor the row's place in the batch moves a bit. Columns are independent, so how H is
tiled does not enter the sum. Weighted: token i (0-based from ``start``) weighs i + 1, as
sentence-transformers' "weightedmean". The fp32 sum is divided by n (mean), sqrt(n) (sentence-
transformers' "mean_sqrt_len_tokens") or n (n + 1) / 2 (weighted), then rounded once to x's dtype;
a row without tokens gives zeros. Forward only.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .configs import tile_device
from .errors import InvalidArgumentError, InvalidDtypeError, UnsupportedOperationError
from .launch import launch, reduction_rows

# Tokens per block of the sum over a row: a constant, the same on every device and for every batch.
BLOCK_T = 16
DIVISORS = {"count": 0, "sqrt_count": 1, "weight_sum": 2}


@triton.jit(do_not_specialize=["L"])
def _pool_tokens_kernel(x_ptr, start_ptr, end_ptr, y_ptr, L, H, WEIGHTED: tl.constexpr, DIVISOR: tl.constexpr,
                        BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_mask = cols < H
    start = tl.load(start_ptr + row).to(tl.int64)
    end = tl.load(end_ptr + row).to(tl.int64)
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for t0 in range(start, end, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        mask = (t < end)[:, None] & col_mask[None, :]
        x = tl.load(x_ptr + (row * L + t)[:, None] * H + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if WEIGHTED:
            x = x * (t - start + 1).to(tl.float32)[:, None]
        acc += tl.sum(x, axis=0)
    n = end - start
    if DIVISOR == 0:
        div = tl.maximum(n, 1).to(tl.float32)
    elif DIVISOR == 1:
        div = tl.sqrt(tl.maximum(n, 1).to(tl.float32))
    else:
        div = tl.maximum(n * (n + 1) // 2, 1).to(tl.float32)
    tl.store(y_ptr + row * H + cols, (acc / div).to(y_ptr.dtype.element_ty), mask=col_mask)


def _block_h(device: torch.device, h: int) -> int:
    """Columns per program: on the interpreter a whole row (it pays per program); on a GPU 256."""
    return triton.next_power_of_2(h) if tile_device(device.type) == "cpu" else min(triton.next_power_of_2(h), 256)


def pool_tokens(x: torch.Tensor, start: torch.Tensor, end: torch.Tensor, weighted: bool = False,
                divisor: str = "count") -> torch.Tensor:
    """[B, H] pooled rows of ``x`` [B, L, H] over tokens ``start[b] .. end[b] - 1`` (integer [B]
    tensors on x's device, 0 <= start <= end <= L, not checked: they are the caller's mask bounds).
    ``weighted``: token i from ``start`` weighs i + 1; ``divisor``: "count" (mean), "sqrt_count"
    or "weight_sum" (weighted mean)."""
    if x.dim() != 3:
        raise InvalidArgumentError(f"pool_tokens: x must be [batch, tokens, hidden], got {tuple(x.shape)}")
    if not x.dtype.is_floating_point:
        raise InvalidDtypeError(f"pool_tokens: x must be floating point, got {x.dtype}")
    b, l, h = x.shape
    if start.shape != (b,) or end.shape != (b,) or start.dtype.is_floating_point or end.dtype.is_floating_point:
        raise InvalidArgumentError(f"pool_tokens: start {tuple(start.shape)} {start.dtype} / end {tuple(end.shape)} "
                                   f"{end.dtype} must be integer tensors of shape ({b},)")
    if divisor not in DIVISORS:
        raise InvalidArgumentError(f"pool_tokens: divisor {divisor!r} is not one of {sorted(DIVISORS)}")
    if x.requires_grad and torch.is_grad_enabled():
        raise UnsupportedOperationError("pool_tokens has no backward: call it under torch.no_grad() or "
                                        "torch.inference_mode()")
    x2 = reduction_rows(x.reshape(-1, h)) if b * l else x.reshape(-1, h)
    y = torch.empty((b, h), device=x.device, dtype=x.dtype)
    block_h = _block_h(x.device, h)
    if b and h:
        launch(_pool_tokens_kernel, (b, triton.cdiv(h, block_h)), x.device, x2, start.contiguous(),
               end.contiguous(), y, l, h, WEIGHTED=weighted, DIVISOR=DIVISORS[divisor], BLOCK_T=BLOCK_T,
               BLOCK_H=block_h, num_warps=4)
    return y
