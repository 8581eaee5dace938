"""Batch-invariant linear layer: y = x @ W^T (+ bias).

Every output element is reduced over K in one order fixed by (device, dtype, N, K) alone: one
tile config per weight shape, no autotuning, no atomics. K may be cut into a fixed number of
chunks (``k_chunks``, a property of the weight shape): each chunk is summed from zero, and the
chunk sums are added in chunk order. That reduction tree can run on two schedules with the
same bits:
  * sequential: one program walks all chunks, adding each chunk's sum into its total;
  * parallel (split-K): one program per chunk writes fp32 partials, and a combine kernel adds
    them in chunk order (``sum_partials``).
The sequential schedule walks every BLOCK_K step of every chunk in one loop, flushing each chunk's
sum into the total at the chunk's last step (``flush_chunk``), so the software pipeline never
restarts at a chunk boundary.
Only the schedule may depend on M (parallel chunks fill the GPU when M is small); the
arithmetic never does.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .configs import LinearConfig, chunk_length, linear_config, tile_device, tile_target
from .launch import DOT_PRECISION, launch
from .silu_mul import rounded_silu
from .errors import InvalidArgumentError, InvalidDtypeError


# Optional prologue applied to each x tile as it is loaded (a fusion). It computes exactly the
# values the standalone kernel would write, so a fused call is bitwise equal to the unfused pair.
# constexpr globals, so the kernel can test PROLOGUE against them by name.
PROLOGUE_NONE = tl.constexpr(0)
PROLOGUE_SILU_MUL = tl.constexpr(1)


@triton.jit(do_not_specialize=["M"])
def _linear_kernel(
    x_ptr, up_ptr, w_ptr, b_ptr, y_ptr,
    M, N, K, CHUNK_K,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_ys, stride_ym, stride_yn,
    HAS_BIAS: tl.constexpr, K_CHUNKS: tl.constexpr, PARALLEL_CHUNKS: tl.constexpr, PROLOGUE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_pid_m = (M + BLOCK_M - 1) // BLOCK_M
    num_pid_n = (N + BLOCK_N - 1) // BLOCK_N
    # Grouped launch order for L2 reuse; it changes which program runs where, never the arithmetic.
    group_size = GROUP_M * num_pid_n
    first_m = (pid // group_size) * GROUP_M
    rows_in_group = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group_size) % rows_in_group
    pid_n = (pid % group_size) // rows_in_group

    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # M * N can pass 2**31 (logits)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if PARALLEL_CHUNKS:  # this program's chunk alone, summed from zero: one accumulator
        k_begin = pid_k * CHUNK_K
        acc = _chunk_dot(tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), x_ptr, up_ptr, w_ptr, offs_m, offs_n,
                         tl.arange(0, BLOCK_K), k_begin, tl.minimum(K, k_begin + CHUNK_K), M, N,
                         stride_xm, stride_xk, stride_wn, stride_wk, PROLOGUE, BLOCK_K, DOT_PRECISION)
    else:
        acc = _k_tree_dot(x_ptr, up_ptr, w_ptr, offs_m, offs_n, 0, K_CHUNKS, M, N, K, CHUNK_K,
                          stride_xm, stride_xk, stride_wn, stride_wk, K_CHUNKS, PROLOGUE, BLOCK_M, BLOCK_N, BLOCK_K,
                          DOT_PRECISION)

    out_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    y_ptrs = y_ptr + pid_k * stride_ys + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn
    if PARALLEL_CHUNKS:
        tl.store(y_ptrs, acc, mask=out_mask)  # fp32 partials, combined in chunk order below
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _k_tree_dot(x_ptr, up_ptr, w_ptr, offs_m, offs_n, first_chunk, last_chunk, M, N, K, CHUNK_K,
                stride_xm, stride_xk, stride_wn, stride_wk,
                K_CHUNKS: tl.constexpr, PROLOGUE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """The fp32 [BLOCK_M, BLOCK_N] sum over chunks first_chunk..last_chunk-1 of the K-chunk tree:
    the reduction order of one output tile, shared by every kernel that must give linear's bits.

    Chunk c covers K range [c * CHUNK_K, min(K, (c + 1) * CHUNK_K)) (configs.chunk_length), walked
    in BLOCK_K steps from its start, its last step masked at its end. One loop walks every step of
    every chunk (the software pipeline never restarts): each chunk is summed from zero into
    ``part``, flushed into the total on the chunk's last step (``flush_chunk``)."""
    offs_k = tl.arange(0, BLOCK_K)
    if K_CHUNKS == 1:
        return _chunk_dot(tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), x_ptr, up_ptr, w_ptr, offs_m, offs_n,
                          offs_k, 0, K, M, N, stride_xm, stride_xk, stride_wn, stride_wk, PROLOGUE, BLOCK_K,
                          DOT_PRECISION)
    steps_per_chunk = (CHUNK_K + BLOCK_K - 1) // BLOCK_K
    last_begin = (last_chunk - 1) * CHUNK_K  # the last chunk may be shorter, or empty past K
    last_steps = (tl.maximum(tl.minimum(K, last_begin + CHUNK_K) - last_begin, 0) + BLOCK_K - 1) // BLOCK_K
    first_step = first_chunk * steps_per_chunk
    end_step = (last_chunk - 1) * steps_per_chunk + tl.maximum(last_steps, 1)
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(first_step, end_step):
        chunk = step // steps_per_chunk
        within = step - chunk * steps_per_chunk
        k_begin = chunk * CHUNK_K
        k_end = tl.minimum(K, k_begin + CHUNK_K)
        part = _step_dot(part, x_ptr, up_ptr, w_ptr, offs_m, offs_n, offs_k, k_begin + within * BLOCK_K, k_end,
                         M, N, stride_xm, stride_xk, stride_wn, stride_wk, PROLOGUE, BLOCK_K, DOT_PRECISION)
        # the chunk's last step: a full chunk's, the last real one of a short chunk, or the loop's
        last = (within == steps_per_chunk - 1) | (k_begin + (within + 1) * BLOCK_K >= k_end) | (step == end_step - 1)
        total, part = flush_chunk(total, part, last)
    return total


@triton.jit
def flush_chunk(total, part, last):
    """(total + part, 0) on a chunk's last step, else (total, part): the one merge of a chunk's fp32
    sum into the K tree's total, branch-free, shared by every GEMM that walks a chunk tree."""
    return tl.where(last, total + part, total), tl.where(last, 0.0, part)


@triton.jit
def _chunk_dot(acc, x_ptr, up_ptr, w_ptr, offs_m, offs_n, offs_k, k_begin, k_end, M, N,
               stride_xm, stride_xk, stride_wn, stride_wk,
               PROLOGUE: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc + x[:, k_begin:k_end] @ w[:, k_begin:k_end]^T, k in order, with the x prologue applied."""
    for k0 in range(k_begin, k_end, BLOCK_K):
        acc = _step_dot(acc, x_ptr, up_ptr, w_ptr, offs_m, offs_n, offs_k, k0, k_end, M, N,
                        stride_xm, stride_xk, stride_wn, stride_wk, PROLOGUE, BLOCK_K, DOT_PRECISION)
    return acc


@triton.jit
def _step_dot(acc, x_ptr, up_ptr, w_ptr, offs_m, offs_n, offs_k, k0, k_end, M, N,
              stride_xm, stride_xk, stride_wn, stride_wk,
              PROLOGUE: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc + the BLOCK_K step at k0 (masked at k_end), with the x prologue applied."""
    ks = k0 + offs_k
    x_offs = offs_m[:, None] * stride_xm + ks[None, :] * stride_xk
    x_mask = (offs_m[:, None] < M) & (ks[None, :] < k_end)
    x = tl.load(x_ptr + x_offs, mask=x_mask, other=0.0)
    if PROLOGUE == PROLOGUE_SILU_MUL:  # x is gate: silu(gate) rounded, times up, rounded (as silu_mul)
        up = tl.load(up_ptr + x_offs, mask=x_mask, other=0.0)
        g = x.to(tl.float32)
        x = (rounded_silu(g, x_ptr.dtype.element_ty) * up.to(tl.float32)).to(x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + offs_n[None, :] * stride_wn + ks[:, None] * stride_wk,
                mask=(offs_n[None, :] < N) & (ks[:, None] < k_end), other=0.0)
    return tl.dot(x, w, acc, input_precision=DOT_PRECISION)


@triton.jit(do_not_specialize=["M", "K_CHUNKS"])
def _chunk_combine_kernel(
    part_ptr, b_ptr, y_ptr, M, N, K_CHUNKS, stride_ps, stride_pm, stride_ym,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = offs_n < N
    acc = sum_partials(part_ptr + row * stride_pm, offs_n, mask, stride_ps, K_CHUNKS)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_ym + offs_n, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def sum_partials(part_ptr, offs_n, mask, stride_ps, K_CHUNKS):
    """The fp32 chunk sums of one output row added in chunk order from zero: the total the
    sequential schedule's ``flush_chunk`` builds, shared by every combine of a K tree. The chunk
    count is a runtime value: one compiled combine serves every weight shape."""
    total = tl.zeros((offs_n.shape[0],), dtype=tl.float32)
    for s in range(0, K_CHUNKS):  # always chunk 0, 1, 2, ... in that order
        total += tl.load(part_ptr + s * stride_ps + offs_n, mask=mask, other=0.0)
    return total


def _check_operands(x, weight, bias):
    if x.dtype != weight.dtype or (bias is not None and bias.dtype != x.dtype):
        raise InvalidDtypeError(f"linear: x, weight and bias must share a dtype, got {x.dtype}, "
                                f"{weight.dtype}{'' if bias is None else ', ' + str(bias.dtype)}")
    if x.device != weight.device:
        raise InvalidArgumentError(f"linear: x on {x.device} but weight on {weight.device}")
    if x.shape[-1] != weight.shape[1]:
        raise InvalidArgumentError(f"linear: x has {x.shape[-1]} features, weight expects {weight.shape[1]}")


SHARED_MEMORY_BUDGET = 96 * 1024  # per block: sm_89's 99 KiB, less room for the epilogue


def pipeline_stages(cfg: LinearConfig, prologue, itemsize: int) -> int:
    """The software pipeline's depth for a launch: the config's, fewer where the silu prologue's
    up tile (one beside each x tile) would pass SHARED_MEMORY_BUDGET. A schedule choice: the
    stages prefetch tiles, the K steps are summed in the same order."""
    x_tiles = 2 if int(prologue) == int(PROLOGUE_SILU_MUL) else 1
    per_stage = (x_tiles * cfg.block_m + cfg.block_n) * cfg.block_k * itemsize
    return max(1, min(cfg.num_stages, SHARED_MEMORY_BUDGET // per_stage))


def parallel_chunks_pays(device: torch.device, m: int, n: int, cfg: LinearConfig) -> bool:
    """The schedule (never the arithmetic): run chunks in parallel when output tiles alone would
    leave most of the GPU idle (small M). The interpreter always runs them in sequence."""
    if cfg.k_chunks == 1 or tile_device(device.type) != "cuda":
        return False
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    return tiles < _sm_count(device)


_SM_COUNTS: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    # Cached in a plain dict: a traced (torch.compile) call then reads a constant.
    if device.type != "cuda":  # CPU tensors recorded for a GPU target (launch_recording)
        return tile_target().sm_count
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNTS[index]


def launch_linear(x2, weight, bias, config, prologue=PROLOGUE_NONE, up=None,
                  parallel_chunks: bool | None = None, partials: bool = False):
    """Launch on 2-D ``x2`` [M, K]; the prologue operands are used only by their prologue.
    ``parallel_chunks`` forces a schedule (tests); by default ``parallel_chunks_pays`` picks it.
    ``partials`` returns the uncombined fp32 chunk sums [k_chunks, M, N] (no bias), for a caller
    that combines them with other chunks of the same tree (``combine_partials``)."""
    m, k = x2.shape
    n = weight.shape[0]
    cfg = config or linear_config(x2.device.type, x2.dtype, n, k)
    if partials:
        if bias is not None:
            raise InvalidArgumentError("linear partials take no bias: combine_partials adds it once")
        parallel_chunks = True
    y = torch.empty((m, n), device=x2.device, dtype=x2.dtype)
    if m == 0:
        return torch.empty((cfg.k_chunks, 0, n), device=x2.device, dtype=torch.float32) if partials else y
    has_bias = bias is not None
    if parallel_chunks is None:
        parallel_chunks = parallel_chunks_pays(x2.device, m, n, cfg)
    parallel_chunks = parallel_chunks and (cfg.k_chunks > 1 or partials)
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n), cfg.k_chunks if parallel_chunks else 1)
    out = torch.empty((cfg.k_chunks, m, n), device=x2.device, dtype=torch.float32) if parallel_chunks else y
    stride_ys = out.stride(0) if parallel_chunks else 0
    launch(
        _linear_kernel, grid, x2.device,
        x2, x2 if up is None else up, weight, bias if has_bias else x2, out,
        m, n, k, chunk_length(cfg, k),
        x2.stride(0), x2.stride(1), weight.stride(0), weight.stride(1),
        stride_ys, out.stride(-2), out.stride(-1),
        HAS_BIAS=has_bias, K_CHUNKS=cfg.k_chunks, PARALLEL_CHUNKS=parallel_chunks, PROLOGUE=int(prologue),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        DOT_PRECISION=DOT_PRECISION,
        num_warps=cfg.num_warps, num_stages=pipeline_stages(cfg, prologue, x2.element_size()),
    )
    if partials:
        return out
    if parallel_chunks:
        _combine(out, bias, y)
    return y


def _combine(parts, bias, y):
    m, n = y.shape
    block_n = 1024
    launch(_chunk_combine_kernel, (m, triton.cdiv(n, block_n)), parts.device,
           parts, parts if bias is None else bias, y, m, n, parts.shape[0], parts.stride(0), parts.stride(1),
           y.stride(0), HAS_BIAS=bias is not None, BLOCK_N=block_n)


def combine_partials(parts: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The fp32 chunk sums ``parts`` [chunks, M, N] added in chunk order (then bias), in ``dtype``:
    the bits ``linear`` gives for that tree, whichever process computed each chunk."""
    if parts.dtype != torch.float32 or parts.dim() != 3 or not parts.is_contiguous():
        raise InvalidArgumentError(f"combine_partials takes contiguous fp32 [chunks, M, N], got {parts.dtype} "
                                   f"{tuple(parts.shape)}")
    y = torch.empty(parts.shape[1:], device=parts.device, dtype=dtype)
    if y.shape[0]:
        _combine(parts, bias, y)
    return y


def linear_partials(x: torch.Tensor, weight: torch.Tensor, config: LinearConfig) -> torch.Tensor:
    """The fp32 sums of each of ``config.k_chunks`` K chunks of x @ W^T, [k_chunks, M, N], uncombined."""
    _check_operands(x, weight, None)
    return launch_linear(x.reshape(-1, weight.shape[1]), weight, None, config, partials=True)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           config: LinearConfig | None = None, parallel_chunks: bool | None = None) -> torch.Tensor:
    """``torch.nn.functional.linear`` with a batch-invariant reduction order.

    ``config`` overrides the per-shape table and ``parallel_chunks`` the schedule; pass them only
    to study configs (tests use them, e.g. for a deliberately M-dependent negative control)."""
    _check_operands(x, weight, bias)
    n, k = weight.shape
    y = launch_linear(x.reshape(-1, k), weight, bias, config, parallel_chunks=parallel_chunks)
    return y.reshape(*x.shape[:-1], n)
