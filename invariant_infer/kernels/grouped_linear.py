"""Grouped expert GEMM for mixture-of-experts layers, bitwise equal to a per-expert loop of ``linear``.

x [T, K] holds the rows routed to the experts, sorted by expert: rows offsets[e]:offsets[e+1]
belong to expert e (an expert may have none), and weight [E, N, K] stacks the experts' weights.
One launch computes every row's ``x[row] @ weight[e]^T``. A program computes one (expert, row
tile, N tile): its rows all belong to one expert, and its tile is reduced over K by the linear
kernel's own ``_k_tree_dot`` with the config ``linear`` uses for the shape (N, K). A row's bits
therefore never depend on how many rows its expert got or on the other experts' rows.

Each program finds its tile from the offsets itself (a prefix sum of the experts' tile counts,
in the kernel), so a launch reads nothing on the host and needs no other launch. The grid has
room for every tile the worst split can need, ceil(T / BLOCK_M) + E; programs past the real
tiles, and so every empty expert, cost one load of the offsets and exit. The chunks of the K
tree run in sequence in one program (the same bits as linear's split-K schedule); there is no
split-K schedule here.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .configs import LinearConfig, chunk_length, linear_config
from .launch import DOT_PRECISION, launch
from .linear import PROLOGUE_NONE, PROLOGUE_SILU_MUL, _k_tree_dot, pipeline_stages
from .errors import InvalidArgumentError, InvalidDtypeError, UnsupportedOperationError


@triton.jit
def _find_tile(offsets_ptr, slot, E, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    """(expert, its row tile, its first row, its row count) of grid slot ``slot``: the experts'
    row tiles laid end to end, in expert order. Past the last tile the expert is >= E."""
    e = tl.arange(0, BLOCK_E)
    lo = tl.load(offsets_ptr + e, mask=e < E, other=0).to(tl.int64)
    hi = tl.load(offsets_ptr + e + 1, mask=e < E, other=0).to(tl.int64)
    tiles = (hi - lo + BLOCK_M - 1) // BLOCK_M  # an empty expert has none
    ends = tl.cumsum(tiles, 0)
    expert = tl.sum((ends <= slot).to(tl.int32), 0)
    this = e == expert
    first_tile = tl.sum(tl.where(this, ends - tiles, 0), 0)
    row_begin = tl.sum(tl.where(this, lo, 0), 0)
    rows = tl.sum(tl.where(this, hi - lo, 0), 0)
    return expert, slot - first_tile, row_begin, rows


@triton.jit
def _grouped_linear_kernel(
    x_ptr, up_ptr, w_ptr, b_ptr, y_ptr, offsets_ptr,
    N, K, E, CHUNK_K,
    stride_xm, stride_xk, stride_we, stride_wn, stride_wk, stride_be, stride_ym, stride_yn,
    HAS_BIAS: tl.constexpr, K_CHUNKS: tl.constexpr, PROLOGUE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    slot = tl.program_id(0)  # fastest: the row tiles of one expert share a weight tile in L2
    pid_n = tl.program_id(1)
    expert, pid_m, row_begin, M = _find_tile(offsets_ptr, slot, E, BLOCK_M, BLOCK_E)
    if expert < E:  # otherwise a spare slot of the worst-case grid: nothing to do
        # The expert's rows and weight as linear sees them: a matrix of M rows and one (N, K) weight.
        x_e = x_ptr + row_begin * stride_xm
        up_e = up_ptr + row_begin * stride_xm
        w_e = w_ptr + expert.to(tl.int64) * stride_we
        offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = _k_tree_dot(x_e, up_e, w_e, offs_m, offs_n, 0, K_CHUNKS, M, N, K, CHUNK_K,
                          stride_xm, stride_xk, stride_wn, stride_wk, K_CHUNKS, PROLOGUE, BLOCK_M, BLOCK_N, BLOCK_K,
                          DOT_PRECISION)
        if HAS_BIAS:
            acc += tl.load(b_ptr + expert.to(tl.int64) * stride_be + offs_n, mask=offs_n < N,
                           other=0.0).to(tl.float32)[None, :]
        y_ptrs = y_ptr + (row_begin + offs_m)[:, None] * stride_ym + offs_n[None, :] * stride_yn
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def grid_slots(rows: int, experts: int, block_m: int) -> int:
    """Row-tile slots enough for any split of ``rows`` rows over ``experts`` experts: each expert
    adds at most one partly filled tile."""
    return triton.cdiv(rows, block_m) + experts


def _check(x, weight, offsets, bias, name, offsets_valid=False):
    if weight.dim() != 3:
        raise InvalidArgumentError(f"{name}: weight must be [E, N, K], got {tuple(weight.shape)}")
    experts, n, k = weight.shape
    if x.dim() != 2 or x.shape[1] != k:
        raise InvalidArgumentError(f"{name}: x must be [T, {k}] for weight {tuple(weight.shape)}, got {tuple(x.shape)}")
    if x.dtype != weight.dtype or (bias is not None and bias.dtype != x.dtype):
        raise InvalidDtypeError(f"{name}: x, weight and bias must share a dtype, got {x.dtype}, "
                                f"{weight.dtype}{'' if bias is None else ', ' + str(bias.dtype)}")
    if bias is not None and bias.shape != (experts, n):
        raise InvalidArgumentError(f"{name}: bias must be [E, N] = [{experts}, {n}], got {tuple(bias.shape)}")
    if offsets.dtype not in (torch.int32, torch.int64) or offsets.shape != (experts + 1,):
        raise InvalidArgumentError(f"{name}: expert_offsets must be int32/int64 [E + 1] = [{experts + 1}], got "
                                   f"{offsets.dtype} {tuple(offsets.shape)}")
    if len({x.device, weight.device, offsets.device} | ({bias.device} if bias is not None else set())) != 1:
        raise InvalidArgumentError(f"{name}: x, weight, expert_offsets and bias must be on one device")
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias)):
        raise UnsupportedOperationError(f"{name} has no backward: call it under torch.no_grad() or "
                                        "torch.inference_mode() (training mixture-of-experts layers is not supported)")
    # Offsets on the host are checked here; on CUDA they are not read (that would sync the host).
    if not x.is_cuda and not offsets_valid and experts and (offsets[0] != 0 or offsets[-1] != x.shape[0]
                                      or bool((offsets[1:] < offsets[:-1]).any())):
        raise InvalidArgumentError(f"{name}: expert_offsets must rise from 0 to T = {x.shape[0]}, got "
                                   f"{offsets.tolist()}")


def launch_grouped_linear(x, up, weight, offsets, bias, prologue, config: LinearConfig | None):
    experts, n, k = weight.shape
    rows = x.shape[0]
    cfg = config or linear_config(x.device.type, x.dtype, n, k)
    y = torch.empty((rows, n), device=x.device, dtype=x.dtype)
    if rows == 0 or experts == 0:
        return y
    grid = (grid_slots(rows, experts, cfg.block_m), triton.cdiv(n, cfg.block_n))
    has_bias = bias is not None
    launch(
        _grouped_linear_kernel, grid, x.device,
        x, x if up is None else up, weight, bias if has_bias else x, y, offsets,
        n, k, experts, chunk_length(cfg, k),
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), weight.stride(2),
        bias.stride(0) if has_bias else 0, y.stride(0), y.stride(1),
        HAS_BIAS=has_bias, K_CHUNKS=cfg.k_chunks, PROLOGUE=int(prologue),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BLOCK_E=triton.next_power_of_2(experts),
        DOT_PRECISION=DOT_PRECISION,
        num_warps=cfg.num_warps, num_stages=pipeline_stages(cfg, prologue, x.element_size()),
    )
    return y


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, expert_offsets: torch.Tensor,
                   bias: torch.Tensor | None = None, config: LinearConfig | None = None,
                   offsets_valid: bool = False) -> torch.Tensor:
    """[T, N]: row r of expert e (offsets[e] <= r < offsets[e + 1]) is bitwise
    ``linear(x[r:r+1], weight[e], bias[e])``. x [T, K] sorted by expert, weight [E, N, K],
    bias [E, N] or None, expert_offsets int32/int64 [E + 1]. ``config`` overrides the per-shape
    table (tests only, as for ``linear``). Offsets that do not rise from 0 to T raise on CPU; on
    CUDA they are not checked (that would sync the host); nor on CPU with ``offsets_valid`` (offsets
    valid by construction, e.g. searchsorted over sorted expert ids)."""
    _check(x, weight, expert_offsets, bias, "grouped_linear", offsets_valid)
    return launch_grouped_linear(x, None, weight, expert_offsets, bias, PROLOGUE_NONE, config)


def grouped_silu_mul_linear(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor,
                            expert_offsets: torch.Tensor, config: LinearConfig | None = None,
                            offsets_valid: bool = False) -> torch.Tensor:
    """[T, N]: per row, bitwise ``linear(silu_mul(gate, up), weight[e])``, without writing silu_mul's
    output (the linear kernel's prologue). gate, up [T, K], e.g. the two halves of gate_up_proj's output."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise InvalidArgumentError(f"grouped_silu_mul_linear: gate {tuple(gate.shape)} {gate.dtype} vs up "
                                   f"{tuple(up.shape)} {up.dtype}")
    _check(gate, weight, expert_offsets, None, "grouped_silu_mul_linear", offsets_valid)
    if gate.stride() != up.stride():  # the kernel walks both with one set of strides
        gate, up = gate.contiguous(), up.contiguous()
    return launch_grouped_linear(gate, up, weight, expert_offsets, None, PROLOGUE_SILU_MUL, config)
