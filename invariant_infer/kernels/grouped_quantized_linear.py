"""Grouped GEMM on quantized expert weights, bitwise equal to a per-expert loop of ``quantized_linear``.

The quantized twin of ``grouped_linear``: x [T, K] holds the rows routed to the experts, sorted by
expert (rows offsets[e]:offsets[e+1] are expert e's), and a stacked ``QuantizedWeight`` holds
every expert's compressed weight ([E, N, K] fp8/int8 or packed, scales [E, ...]). A program
computes one (expert, row tile, N tile) with ``quantized_linear``'s own K loop
(``_quantized_dot``) and tile config (its K chunks in sequence), so a row's bits never depend on
how many rows its expert got or on the other experts' rows. Activations quantized per token (``quantize_activations``)
are sorted with their rows; a per-tensor activation scale over all routed rows, the batch-variant
bug of stock fused-MoE FP8, has no place here.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .grouped_linear import _find_tile, grid_slots
from .launch import DOT_PRECISION, launch
from .quantized_linear import (QuantizedLinearConfig, QuantizedWeight, _quantized_dot, check_activations, launch_args,
                               quantized_linear_config)
from .errors import InvalidArgumentError


@triton.jit
def _grouped_quantized_linear_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, zp_ptr, y_ptr, offsets_ptr, N, K, E, CHUNK_K,
    stride_xm, stride_xsm, stride_we, stride_wn, stride_se, stride_sn, stride_ze, stride_zn, stride_ym,
    FORMAT: tl.constexpr, BITS: tl.constexpr, SCALE_GROUP_K: tl.constexpr, SCALE_GROUP_N: tl.constexpr,
    HAS_ZP: tl.constexpr, ACT_QUANT: tl.constexpr, GROUPED: tl.constexpr, K_CHUNKS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    slot = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert, pid_m, row_begin, M = _find_tile(offsets_ptr, slot, E, BLOCK_M, BLOCK_E)
    if expert < E:  # otherwise a spare slot of the worst-case grid
        e = expert.to(tl.int64)
        offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = _quantized_dot(x_ptr + row_begin * stride_xm, xs_ptr + row_begin * stride_xsm, w_ptr + e * stride_we,
                             ws_ptr + e * stride_se, zp_ptr + e * stride_ze, offs_m, offs_n, M, N, K, 0, K, CHUNK_K,
                             stride_xm, stride_xsm, stride_wn, stride_sn, stride_zn,
                             FORMAT, BITS, SCALE_GROUP_K, SCALE_GROUP_N, HAS_ZP, ACT_QUANT, GROUPED, K_CHUNKS, True,
                             BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION)
        y_ptrs = y_ptr + (row_begin + offs_m)[:, None] * stride_ym + offs_n[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def _check(x, weight, offsets, x_scale):
    experts = weight.experts
    if experts is None or weight.scale.dim() != 3 or weight.scale.shape[0] != experts:
        raise InvalidArgumentError("grouped_quantized_linear: weight must stack the experts' tensors ([E, ...]), got "
                                   f"data {tuple(weight.data.shape)} and scales {tuple(weight.scale.shape)}")
    if x.dim() != 2 or (x_scale is not None and (x_scale.dim() != 2 or x_scale.shape[0] != x.shape[0])):
        raise InvalidArgumentError("grouped_quantized_linear: x must be [T, K] with x_scale [T, groups], got "
                                   f"{tuple(x.shape)}{'' if x_scale is None else ' and ' + str(tuple(x_scale.shape))}")
    if offsets.dtype not in (torch.int32, torch.int64) or offsets.shape != (experts + 1,):
        raise InvalidArgumentError("grouped_quantized_linear: expert_offsets must be int32/int64 [E + 1] = "
                                   f"[{experts + 1}], got {offsets.dtype} {tuple(offsets.shape)}")
    if len({x.device, weight.data.device, offsets.device}) != 1:
        raise InvalidArgumentError("grouped_quantized_linear: x, weight and expert_offsets must be on one device")
    # Offsets on the host are checked here; on CUDA they are not read (that would sync the host).
    if not x.is_cuda and experts and (offsets[0] != 0 or offsets[-1] != x.shape[0]
                                      or bool((offsets[1:] < offsets[:-1]).any())):
        raise InvalidArgumentError(f"grouped_quantized_linear: expert_offsets must rise from 0 to T = {x.shape[0]}, "
                                   f"got {offsets.tolist()}")


def grouped_quantized_linear(x: torch.Tensor, weight: QuantizedWeight, expert_offsets: torch.Tensor,
                             x_scale: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                             config: QuantizedLinearConfig | None = None) -> torch.Tensor:
    """[T, N]: row r of expert e (offsets[e] <= r < offsets[e + 1]) is bitwise
    ``quantized_linear(x[r:r+1], weight.expert(e), x_scale=x_scale[r:r+1], out_dtype=out_dtype)``.

    ``weight`` stacks E experts' compressed weights ([E, N, K] values, [E, ...] scales, per-expert
    ``shape`` (N, K)); x [T, K] and x_scale as ``quantized_linear`` takes them, sorted by expert."""
    check_activations("grouped_quantized_linear", x, weight, x_scale, out_dtype)
    _check(x, weight, expert_offsets, x_scale)
    experts, (n, k) = weight.experts, weight.shape
    act_quant = x_scale is not None
    if x.stride(-1) != 1:
        x = x.contiguous()
    xs = x_scale.contiguous() if act_quant else x
    rows = x.shape[0]
    y = torch.empty((rows, n), device=x.device, dtype=out_dtype or x.dtype)
    if rows == 0 or experts == 0:
        return y
    cfg = config or quantized_linear_config(x.device.type, weight)
    zp = weight.zero_point if weight.zero_point is not None else weight.scale
    stride_ze, stride_zn = (zp.stride(0), zp.stride(1)) if weight.zero_point is not None else (0, 0)
    launch(_grouped_quantized_linear_kernel, (grid_slots(rows, experts, cfg.block_m), triton.cdiv(n, cfg.block_n)),
           x.device, x, xs, weight.data, weight.scale, zp, y, expert_offsets, n, k, experts, cfg.chunk_k,
           x.stride(0), xs.stride(0), weight.data.stride(0), weight.data.stride(1), weight.scale.stride(0),
           weight.scale.stride(1), stride_ze, stride_zn, y.stride(0),
           **launch_args(weight), ACT_QUANT=act_quant, GROUPED=weight.scale_group_k < k, K_CHUNKS=cfg.k_chunks,
           BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BLOCK_E=triton.next_power_of_2(experts),
           DOT_PRECISION=DOT_PRECISION, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y
