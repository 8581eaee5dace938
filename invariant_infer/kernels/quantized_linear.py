"""Batch-invariant linear layer on quantized weights: y = x @ dequant(W)^T (+ bias).

The weight stays in its checkpoint format; each K tile is loaded and dequantized inside the K
loop, and every output element is reduced over K in one order fixed by the weight's shape and
format (one tile config per weight, never chosen by M; no atomics). On a GPU, K is cut into
chunks of whole scale groups by linear's rule (``linear_configs.chunk_steps``): each chunk summed
from zero, the chunk sums added in chunk order (the same ``flush_chunk`` / ``sum_partials`` as
linear), then the per-channel and per-token scales. The chunks run in sequence in one program, or
in parallel (split-K) at small M with a combine kernel: the same bits.

Weight formats: ``quantized_weight.QuantizedWeight``.

Activations:
  * bf16/fp16 (weight-only, W4A16/W8A16): the weight tile is dequantized to the activation dtype,
    ``(q * scale)`` rounded to the scale's dtype first, as compressed-tensors decompresses, then
    multiplied in the activation dtype with fp32 accumulation;
  * quantized per token (W8A8, ``quantize_activations``): fp8 x fp8 or int8 x int8 products.
    int8 partial sums are exact in int32 and scaled once at the end; fp8 partial products of each
    K tile are summed from zero and promoted into the fp32 accumulator once per tile (Hopper's fp8
    MMA accumulates in limited precision); per-group/block scales multiply each tile's partial
    sum (``x_scale[m, k // 128] * w_scale[n // 128, k // 128]``). Per-channel/per-token scales
    are applied once, after the K loop, as ``(acc * x_scale[m]) * w_scale[n]``.
On CPU the interpreter's dot is the harness's fixed-order fp32 sum; fp8 operands are widened to
fp32 exactly, so a product is exact and only the order of the sum differs from a GPU MMA, which
also sums in an order fixed per instruction: the batch-invariance holds on both.

Row-parallel layers under tensor parallelism reduce K as a tree instead (``quantized_linear_partials``):
``quantized_tree_leaves`` equal chunks of whole scale groups, each reduced from zero by the same K
loop, their fp32 sums added in chunk order by ``linear.combine_partials``, whichever rank computed each.
"""
from __future__ import annotations


import torch
import triton
import triton.language as tl

from .fp8_support import check_fp8_device
from .launch import DOT_PRECISION, launch
from .linear import flush_chunk, parallel_chunks_pays, sum_partials
from .quantized_weight import BLOCK, QuantizedLinearConfig, QuantizedWeight, quantized_linear_config
from .errors import InvalidArgumentError, InvalidDtypeError

_FORMAT_CODE = {"fp8": 0, "int8": 1, "packed": 2}
# BLOCK as the kernels read it: compiled Triton reads only constexpr globals (the interpreter reads any).
ACTIVATION_GROUP = tl.constexpr(BLOCK)


@triton.jit
def _weight_tile(w_ptr, offs_n, k0, N, K, stride_wn, FORMAT: tl.constexpr, BITS: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """The [BLOCK_K, BLOCK_N] tile of stored weight values at (k0 + [0, BLOCK_K), offs_n): fp8 or
    int8 as stored, packed integers unpacked to int32 (masked entries are 0). Packed words are
    loaded once each ([BLOCK_K / per_word, BLOCK_N]; k0 is a multiple of per_word) and unpacked
    in registers: element k is word k // per_word, bits (k % per_word) * BITS."""
    ks = k0 + tl.arange(0, BLOCK_K)
    mask = (offs_n[None, :] < N) & (ks[:, None] < K)
    if FORMAT == 2:
        per_word: tl.constexpr = 32 // BITS
        WORDS: tl.constexpr = BLOCK_K // per_word
        word_ks = k0 + tl.arange(0, WORDS) * per_word  # the first k of each word
        words = tl.load(w_ptr + offs_n[None, :] * stride_wn + (word_ks[:, None] // per_word),
                        mask=(offs_n[None, :] < N) & (word_ks[:, None] < K), other=0)
        shift = tl.arange(0, per_word) * BITS
        fields = (words[:, None, :] >> shift[None, :, None]) & ((1 << BITS) - 1)
        q = tl.reshape(fields, (BLOCK_K, offs_n.shape[0])) - (1 << (BITS - 1))
        return tl.where(mask, q, 0)
    return tl.load(w_ptr + offs_n[None, :] * stride_wn + ks[:, None], mask=mask, other=0.0)


@triton.jit
def _dequantized_tile(w_ptr, ws_ptr, zp_ptr, offs_n, k0, N, K, stride_wn, stride_sn, stride_zn,
                      SCALE_GROUP_K: tl.constexpr, SCALE_GROUP_N: tl.constexpr, FORMAT: tl.constexpr,
                      BITS: tl.constexpr, HAS_ZP: tl.constexpr, BLOCK_K: tl.constexpr):
    """The tile dequantized in the scale's dtype: ((q - zero_point) * scale) rounded once, as
    compressed-tensors' ``(q.to(scale.dtype) - zp.to(scale.dtype)) * scale`` gives (the integer
    difference is exact in bf16/fp16 and fp32, the product exact in fp32). When the scale group
    holds whole K tiles (every config ``quantized_linear_config`` gives), the tile's scales and
    zero points are one [1, BLOCK_N] row, loaded once and broadcast along K."""
    q = _weight_tile(w_ptr, offs_n, k0, N, K, stride_wn, FORMAT, BITS, BLOCK_K)
    ks = k0 + tl.arange(0, BLOCK_K)
    smask = (offs_n[None, :] < N) & (ks[:, None] < K)
    if SCALE_GROUP_K % BLOCK_K == 0:
        group_k = tl.zeros((1,), dtype=tl.int32) + k0 // SCALE_GROUP_K
        load_mask = offs_n[None, :] < N
    else:  # a custom config's K tile across scale groups: one column per k
        group_k = ks // SCALE_GROUP_K
        load_mask = smask
    if HAS_ZP:
        per_word: tl.constexpr = 32 // BITS
        zwords = tl.load(zp_ptr + (offs_n[None, :] // per_word) * stride_zn + group_k[:, None],
                         mask=load_mask, other=0)
        zp = ((zwords >> ((offs_n[None, :] % per_word) * BITS)) & ((1 << BITS) - 1)) - (1 << (BITS - 1))
        q = tl.where(smask, q - zp, 0)
    s = tl.load(ws_ptr + (offs_n[None, :] // SCALE_GROUP_N) * stride_sn + group_k[:, None],
                mask=load_mask, other=0.0)
    s = tl.where(smask, s, 0.0)
    return (q.to(tl.float32) * s.to(tl.float32)).to(ws_ptr.dtype.element_ty)


@triton.jit
def _quantized_dot(x_ptr, xs_ptr, w_ptr, ws_ptr, zp_ptr, offs_m, offs_n, M, N, K, K_BEGIN, K_END, CHUNK_K,
                   stride_xm, stride_xsm, stride_wn, stride_sn, stride_zn,
                   FORMAT: tl.constexpr, BITS: tl.constexpr, SCALE_GROUP_K: tl.constexpr,
                   SCALE_GROUP_N: tl.constexpr, HAS_ZP: tl.constexpr, ACT_QUANT: tl.constexpr,
                   GROUPED: tl.constexpr, K_CHUNKS: tl.constexpr, APPLY_SCALES: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   DOT_PRECISION: tl.constexpr):
    """The fp32 [BLOCK_M, BLOCK_N] tile of ``x[:, K_BEGIN:K_END] @ dequant(W)[:, K_BEGIN:K_END]^T``
    at (offs_m, offs_n): the K loop every quantized GEMM here runs, one order for any M.
    ``GROUPED``: the scales go per K group or block, applied to each K tile. ``K_CHUNKS`` > 1: K is
    a tree of chunks of CHUNK_K (a multiple of BLOCK_K) from K_BEGIN, each summed from zero (int8:
    exactly, in int32, then converted) and flushed into the total at its last tile, in one loop.
    ``APPLY_SCALES``: the per-token and per-channel scales (not grouped) multiply the total here;
    a split-K partial leaves them to the combine."""
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    grouped = GROUPED
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    iacc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k0 in range(K_BEGIN, K_END, BLOCK_K):
        ks = k0 + offs_k
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + ks[None, :],
                    mask=m_mask[:, None] & (ks[None, :] < K_END), other=0.0)
        if ACT_QUANT:
            w = _weight_tile(w_ptr, offs_n, k0, N, K_END, stride_wn, FORMAT, BITS, BLOCK_K)
            if FORMAT == 1:  # int8: exact int32 sums over the chunk (all of K with one chunk)
                iacc = tl.dot(x, w, iacc, out_dtype=tl.int32)  # stated: Triton < 3.7 defaults to fp32
            else:  # fp8: the tile's partial sum from zero, promoted once per K tile
                part = tl.dot(x, w, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), input_precision=DOT_PRECISION)
                if grouped:
                    xs = tl.load(xs_ptr + offs_m * stride_xsm + k0 // ACTIVATION_GROUP, mask=m_mask, other=0.0)
                    ws = tl.load(ws_ptr + (offs_n // SCALE_GROUP_N) * stride_sn + k0 // SCALE_GROUP_K,
                                 mask=offs_n < N, other=0.0).to(tl.float32)
                    part = part * (xs[:, None] * ws[None, :])
                acc += part
        else:
            w = _dequantized_tile(w_ptr, ws_ptr, zp_ptr, offs_n, k0, N, K_END, stride_wn, stride_sn, stride_zn,
                                  SCALE_GROUP_K, SCALE_GROUP_N, FORMAT, BITS, HAS_ZP,
                                  BLOCK_K).to(x_ptr.dtype.element_ty)
            acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
        if K_CHUNKS > 1:
            last = ((k0 + BLOCK_K - K_BEGIN) % CHUNK_K == 0) | (k0 + BLOCK_K >= K_END)
            if ACT_QUANT and FORMAT == 1:
                total, _ = flush_chunk(total, iacc.to(tl.float32), last)
                iacc = tl.where(last, 0, iacc)
            else:
                total, acc = flush_chunk(total, acc, last)
    if K_CHUNKS == 1:
        total = iacc.to(tl.float32) if ACT_QUANT and FORMAT == 1 else acc
    if ACT_QUANT and APPLY_SCALES:
        if not grouped:  # per token x per channel, once, after the K loop
            xs = tl.load(xs_ptr + offs_m * stride_xsm, mask=m_mask, other=0.0)
            ws = tl.load(ws_ptr + (offs_n // SCALE_GROUP_N) * stride_sn, mask=offs_n < N, other=0.0).to(tl.float32)
            total = (total * xs[:, None]) * ws[None, :]
    return total


@triton.jit(do_not_specialize=["M"])
def _quantized_linear_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, zp_ptr, b_ptr, y_ptr, M, N, K, CHUNK_K,
    stride_xm, stride_xsm, stride_wn, stride_sn, stride_zn, stride_ym,
    FORMAT: tl.constexpr, BITS: tl.constexpr, SCALE_GROUP_K: tl.constexpr, SCALE_GROUP_N: tl.constexpr,
    HAS_ZP: tl.constexpr, GROUPED: tl.constexpr, K_CHUNKS: tl.constexpr,
    ACT_QUANT: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = _quantized_dot(x_ptr, xs_ptr, w_ptr, ws_ptr, zp_ptr, offs_m, offs_n, M, N, K, 0, K, CHUNK_K,
                         stride_xm, stride_xsm, stride_wn, stride_sn, stride_zn,
                         FORMAT, BITS, SCALE_GROUP_K, SCALE_GROUP_N, HAS_ZP, ACT_QUANT, GROUPED, K_CHUNKS, True,
                         BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    out_mask = (offs_m < M)[:, None] & (offs_n[None, :] < N)
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty), mask=out_mask)


@triton.jit(do_not_specialize=["M"])
def _quantized_partials_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, zp_ptr, p_ptr, M, N, K, CHUNK_K,
    stride_xm, stride_xsm, stride_wn, stride_sn, stride_zn, stride_pc, stride_pm,
    FORMAT: tl.constexpr, BITS: tl.constexpr, SCALE_GROUP_K: tl.constexpr, SCALE_GROUP_N: tl.constexpr,
    HAS_ZP: tl.constexpr, ACT_QUANT: tl.constexpr, GROUPED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One K chunk's fp32 sum per program (axis 2: the chunk), for a tree over K; per-token and
    per-channel scales (not ``GROUPED``) are left to the combine."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    chunk = tl.program_id(2)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_begin = chunk * CHUNK_K
    acc = _quantized_dot(x_ptr, xs_ptr, w_ptr, ws_ptr, zp_ptr, offs_m, offs_n, M, N, K, k_begin,
                         tl.minimum(K, k_begin + CHUNK_K), CHUNK_K, stride_xm, stride_xsm, stride_wn, stride_sn,
                         stride_zn, FORMAT, BITS, SCALE_GROUP_K, SCALE_GROUP_N, HAS_ZP, ACT_QUANT, GROUPED, 1,
                         False, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION)
    out_mask = (offs_m < M)[:, None] & (offs_n[None, :] < N)
    tl.store(p_ptr + chunk.to(tl.int64) * stride_pc + offs_m[:, None] * stride_pm + offs_n[None, :], acc,
             mask=out_mask)


@triton.jit(do_not_specialize=["M", "K_CHUNKS"])
def _quantized_combine_kernel(part_ptr, xs_ptr, ws_ptr, b_ptr, y_ptr, M, N, K_CHUNKS, stride_ps, stride_pm,
                              stride_xsm, stride_sn, stride_ym, SCALE: tl.constexpr, SCALE_GROUP_N: tl.constexpr,
                              HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr):
    """A split-K row: the chunk sums in chunk order, then the per-token and per-channel scales
    (``SCALE``) and the bias, as ``_quantized_linear_kernel`` applies them after its K loop."""
    row = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = offs_n < N
    acc = sum_partials(part_ptr + row * stride_pm, offs_n, mask, stride_ps, K_CHUNKS)
    if SCALE:
        xs = tl.load(xs_ptr + row * stride_xsm)
        ws = tl.load(ws_ptr + (offs_n // SCALE_GROUP_N) * stride_sn, mask=mask, other=0.0).to(tl.float32)
        acc = (acc * xs) * ws
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_ym + offs_n, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dequantize_kernel(w_ptr, ws_ptr, zp_ptr, out_ptr, N, K, stride_wn, stride_sn, stride_zn, stride_on,
                       FORMAT: tl.constexpr, BITS: tl.constexpr, SCALE_GROUP_K: tl.constexpr,
                       SCALE_GROUP_N: tl.constexpr, HAS_ZP: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    ks = k0 + tl.arange(0, BLOCK_K)
    w = _dequantized_tile(w_ptr, ws_ptr, zp_ptr, offs_n, k0, N, K, stride_wn, stride_sn, stride_zn,
                          SCALE_GROUP_K, SCALE_GROUP_N, FORMAT, BITS, HAS_ZP, BLOCK_K)
    tl.store(out_ptr + offs_n[None, :] * stride_on + ks[:, None], w,
             mask=(offs_n[None, :] < N) & (ks[:, None] < K))


def launch_args(weight: QuantizedWeight):
    return dict(FORMAT=_FORMAT_CODE[weight.format], BITS=weight.bits if weight.format == "packed" else 8,
                SCALE_GROUP_K=weight.scale_group_k, SCALE_GROUP_N=BLOCK if weight.block else 1,
                HAS_ZP=weight.zero_point is not None)


def zero_point_args(weight: QuantizedWeight):
    zp = weight.zero_point
    return (zp, zp.stride(0)) if zp is not None else (weight.scale, 0)


def dequantize_weight(weight: QuantizedWeight) -> torch.Tensor:
    """The dense [N, K] weight in the scale's dtype, computed by the tile code the K loop runs:
    the values the weight-only path multiplies (and compressed-tensors' decompression gives)."""
    n, k = weight.shape
    if weight.format == "fp8":
        check_fp8_device("dequantize_weight", weight.data.device)
    out = torch.empty((n, k), device=weight.data.device, dtype=weight.scale.dtype)
    cfg = quantized_linear_config(weight.data.device.type, weight)
    launch(_dequantize_kernel, (triton.cdiv(n, cfg.block_n), triton.cdiv(k, cfg.block_k)), weight.data.device,
           weight.data, weight.scale, zero_point_args(weight)[0], out, n, k, weight.data.stride(0),
           weight.scale.stride(0), zero_point_args(weight)[1], out.stride(0),
           **launch_args(weight), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k)
    return out


def check_activations(name: str, x: torch.Tensor, weight: QuantizedWeight, x_scale: torch.Tensor | None,
                      out_dtype: torch.dtype | None) -> None:
    """Refuse activations (and their scales) that ``weight``'s format does not take, and fp8 on a
    GPU without it."""
    k = weight.shape[1]
    if weight.format == "fp8" or x.dtype == torch.float8_e4m3fn:
        check_fp8_device(name, x.device)
    if x.shape[-1] != k:
        raise InvalidArgumentError(f"{name}: x has {x.shape[-1]} features, weight expects {k}")
    if x_scale is not None:
        expected = torch.int8 if weight.format == "int8" else torch.float8_e4m3fn
        if x.dtype != expected or out_dtype is None:
            raise InvalidDtypeError(f"{name}: {weight.format} weights take {expected} activations and an out_dtype, "
                                    f"got {x.dtype}")
        if weight.format == "packed" or (weight.format == "int8" and weight.scale_group_k < k):
            raise InvalidArgumentError("quantized activations take fp8 or per-channel int8 weights")
        groups = x_scale.shape[-1]
        if groups != (k // BLOCK if weight.scale_group_k < k else 1) or (groups > 1 and weight.scale_group_k != BLOCK):
            raise InvalidArgumentError(f"x_scale has {groups} groups per token, weight {weight.format} needs "
                                       f"{k // BLOCK if weight.scale_group_k < k else 1}")
    elif x.dtype not in (torch.bfloat16, torch.float16):
        raise InvalidDtypeError(f"{name}: weight-only activations must be bf16 or fp16, got {x.dtype}")


def quantized_linear(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None,
                     x_scale: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                     config: QuantizedLinearConfig | None = None,
                     parallel_chunks: bool | None = None) -> torch.Tensor:
    """``x @ dequant(weight)^T + bias`` with a batch-invariant reduction order.

    ``x`` [..., K] is bf16/fp16 (weight-only), or fp8/int8 values from ``quantize_activations``
    with their fp32 ``x_scale`` [..., 1 or K / 128]; then ``out_dtype`` is the output's dtype.
    ``parallel_chunks`` forces the schedule of a config's K chunks (tests); by default split-K runs
    where ``linear.parallel_chunks_pays``."""
    n, k = weight.shape
    check_activations("quantized_linear", x, weight, x_scale, out_dtype)
    act_quant = x_scale is not None
    out_dtype = out_dtype or x.dtype
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    xs2 = x_scale.reshape(-1, x_scale.shape[-1]).contiguous() if act_quant else x2
    m = x2.shape[0]
    y = torch.empty((m, n), device=x.device, dtype=out_dtype)
    cfg = config or quantized_linear_config(x.device.type, weight)
    grouped = weight.scale_group_k < k
    if cfg.k_chunks > 1 and (cfg.chunk_k % cfg.block_k or (grouped and cfg.chunk_k % weight.scale_group_k)
                             or (cfg.k_chunks - 1) * cfg.chunk_k >= k):
        raise InvalidArgumentError(f"quantized_linear: {cfg.k_chunks} chunks of {cfg.chunk_k} do not cut K = {k} into "
                                   f"whole BLOCK_Ks ({cfg.block_k}) of whole scale groups ({weight.scale_group_k})")
    if parallel_chunks is None:
        parallel_chunks = parallel_chunks_pays(x.device, m, n, cfg)
    if m and parallel_chunks and cfg.k_chunks > 1:
        parts = torch.empty((cfg.k_chunks, m, n), device=x.device, dtype=torch.float32)
        launch(_quantized_partials_kernel, (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), cfg.k_chunks),
               x.device, x2, xs2, weight.data, weight.scale, zero_point_args(weight)[0], parts, m, n, k, cfg.chunk_k,
               x2.stride(0), xs2.stride(0), weight.data.stride(0), weight.scale.stride(0),
               zero_point_args(weight)[1], parts.stride(0), parts.stride(1),
               **launch_args(weight), ACT_QUANT=act_quant, GROUPED=grouped,
               BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, DOT_PRECISION=DOT_PRECISION,
               num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        block_n = 1024
        launch(_quantized_combine_kernel, (m, triton.cdiv(n, block_n)), x.device,
               parts, xs2, weight.scale, bias if bias is not None else parts, y, m, n, cfg.k_chunks, parts.stride(0),
               parts.stride(1), xs2.stride(0), weight.scale.stride(0), y.stride(0),
               SCALE=act_quant and not grouped, SCALE_GROUP_N=BLOCK if weight.block else 1, HAS_BIAS=bias is not None,
               BLOCK_N=block_n)
    elif m:
        launch(_quantized_linear_kernel, (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n)), x.device,
               x2, xs2, weight.data, weight.scale, zero_point_args(weight)[0], bias if bias is not None else x2, y,
               m, n, k, cfg.chunk_k, x2.stride(0), xs2.stride(0), weight.data.stride(0), weight.scale.stride(0),
               zero_point_args(weight)[1], y.stride(0),
               **launch_args(weight), GROUPED=grouped, K_CHUNKS=cfg.k_chunks, ACT_QUANT=act_quant,
               HAS_BIAS=bias is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
               DOT_PRECISION=DOT_PRECISION, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y.reshape(*x.shape[:-1], n)


def quantized_tree_leaves(weight: QuantizedWeight, k: int | None = None) -> int:
    """The leaves of a row-parallel quantized layer's K tree: the largest power of two, at most
    8, that splits K (``k``, default the weight's) into whole scale groups, so that tensor-parallel
    shards of whole leaves split no group. 1 for per-channel weights (no group to align with)."""
    k = k or weight.shape[1]
    group = weight.scale_group_k
    if not (weight.block or weight.group_size) or k % group:
        return 1
    leaves = 1
    while leaves < 8 and (k // group) % (leaves * 2) == 0:
        leaves *= 2
    return leaves


def quantized_linear_partials(x: torch.Tensor, weight: QuantizedWeight, k_chunks: int,
                              x_scale: torch.Tensor | None = None,
                              config: QuantizedLinearConfig | None = None) -> torch.Tensor:
    """The fp32 sums of ``k_chunks`` equal K chunks of ``x @ dequant(weight)^T``, [k_chunks, M, N],
    uncombined (``linear.combine_partials`` adds them in chunk order, then the bias). Each chunk
    holds whole scale groups and is reduced as ``quantized_linear`` reduces K, from zero; group
    and block formats only (per-channel and per-token scales apply to the whole of K)."""
    n, k = weight.shape
    check_activations("quantized_linear_partials", x, weight, x_scale, torch.float32)
    if not (weight.block or weight.group_size) or (x_scale is not None and weight.format != "fp8"):
        raise InvalidArgumentError("quantized_linear_partials takes group or block formats (weight-only packed, fp8 "
                                   "blocks)")
    chunk_k = k // k_chunks
    if k_chunks < 1 or k % k_chunks or chunk_k % weight.scale_group_k:
        raise InvalidArgumentError(f"quantized_linear_partials: {k_chunks} chunks of K = {k} do not hold whole scale "
                                   f"groups of {weight.scale_group_k}")
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    act_quant = x_scale is not None
    xs2 = x_scale.reshape(-1, x_scale.shape[-1]).contiguous() if act_quant else x2
    m = x2.shape[0]
    parts = torch.empty((k_chunks, m, n), device=x.device, dtype=torch.float32)
    cfg = config or quantized_linear_config(x.device.type, weight)
    if m:
        launch(_quantized_partials_kernel, (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), k_chunks),
               x.device, x2, xs2, weight.data, weight.scale, zero_point_args(weight)[0], parts, m, n, k, chunk_k,
               x2.stride(0), xs2.stride(0), weight.data.stride(0), weight.scale.stride(0),
               zero_point_args(weight)[1], parts.stride(0), parts.stride(1),
               **launch_args(weight), ACT_QUANT=act_quant, GROUPED=True,
               BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, DOT_PRECISION=DOT_PRECISION,
               num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return parts
