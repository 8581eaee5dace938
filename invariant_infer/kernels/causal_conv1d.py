"""Causal depthwise conv1d with SiLU (Gated DeltaNet's short convolution) over packed segments.

out[t, c] = silu(sum_s weight[c, s] * x[t - (K - 1) + s, c]), the K products summed in s order in
fp32, rounded to x's dtype, then SiLU in fp32 and rounded again (as a conv in the model dtype
followed by torch's SiLU). Each element is the same code wherever it sits; inputs before a
segment's first token are zeros, as for a sequence alone. A caller that continues a sequence
prepends its last K - 1 inputs to the segment and writes outputs from the first new token
(``out_from``), so a decode step computes each output from the same K inputs, in the same order,
as a forward over the whole sequence.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .errors import InvalidArgumentError
from .launch import launch
from .configs import tile_device


@triton.jit(do_not_specialize=["num_segments"])
def _causal_conv1d_silu_kernel(x_ptr, w_ptr, out_ptr, seg_start_ptr, seg_end_ptr, out_from_ptr, num_segments, C,
                               stride_xt, stride_ot, KERNEL: tl.constexpr, BLOCK_T: tl.constexpr,
                               BLOCK_C: tl.constexpr):
    seg = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < C
    start = tl.load(seg_start_ptr + seg).to(tl.int64)
    end = tl.load(seg_end_ptr + seg).to(tl.int64)
    out_from = tl.load(out_from_ptr + seg).to(tl.int64)
    for t0 in range(out_from, end, BLOCK_T):
        rows = t0 + tl.arange(0, BLOCK_T)
        acc = tl.zeros((BLOCK_T, BLOCK_C), tl.float32)
        for s in tl.static_range(KERNEL):
            src = rows - (KERNEL - 1) + s
            ok = (src >= start) & (src < end)
            x = tl.load(x_ptr + src[:, None] * stride_xt + cols[None, :], mask=ok[:, None] & col_mask[None, :],
                        other=0.0).to(tl.float32)
            w = tl.load(w_ptr + cols * KERNEL + s, mask=col_mask, other=0.0).to(tl.float32)
            acc += x * w[None, :]
        conv = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
        out = conv / (1.0 + tl.exp(-conv))
        tl.store(out_ptr + rows[:, None] * stride_ot + cols[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=(rows < end)[:, None] & col_mask[None, :])


def causal_conv1d_silu(x: torch.Tensor, weight: torch.Tensor, seg_start: torch.Tensor, seg_end: torch.Tensor,
                       out_from: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, C] (packed tokens), weight [C, K]; segments [seg_start[s], seg_end[s]) (int32 [S]).
    Returns [T, C] in x's dtype; only rows from ``out_from[s]`` (default ``seg_start``) to each
    segment's end are written (the others are zero)."""
    tokens, channels = x.shape
    if weight.dim() != 2 or weight.shape[0] != channels:
        raise InvalidArgumentError(f"causal_conv1d_silu: weight {tuple(weight.shape)} for {channels} channels")
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight.contiguous()
    out = torch.zeros_like(x, memory_format=torch.contiguous_format)
    segments = seg_start.shape[0]
    if segments == 0 or tokens == 0:
        return out
    out_from = seg_start if out_from is None else out_from
    cpu = tile_device(x.device.type) == "cpu"  # few, large programs for the interpreter
    block_c = min(triton.next_power_of_2(channels), 1024 if cpu else 128)
    block_t = 64 if cpu else 16
    launch(_causal_conv1d_silu_kernel, (segments, triton.cdiv(channels, block_c)), x.device,
           x, weight, out, seg_start, seg_end, out_from, segments, channels, x.stride(0), out.stride(0),
           KERNEL=weight.shape[1], BLOCK_T=block_t, BLOCK_C=block_c)
    return out
