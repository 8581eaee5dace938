"""Autograd for the batch-invariant attention: a FlashAttention-2-style backward, no atomics.

The forward is ``attention``'s kernel, which also stores each query row's log-sum-exp (LSE);
its output is bit for bit ``attention``'s. The backward recomputes P = exp(q k^T * scale - LSE)
block by block and runs three kernels:
  * preprocess: delta = rowsum(dO * O) in fp32, one query row at a time;
  * dK/dV: one program per (row b, KV head, KV block). KV blocks are the forward's: BLOCK_N wide,
    starting at kv_start[b]. The program sums over the GROUP query heads of its KV head in order,
    and for each over query tiles in ascending order, in fp32 registers. The query tiles are
    BLOCK_M positions wide and start at kv_start[b] too (positions, not row indices), so the same
    real queries always fall into the same tile slots: the amount or side of padding, and the
    other rows of the batch, never regroup a key's sum;
  * dQ: one program per query tile, walking the same KV blocks as the forward, in the same order.
Each output element is reduced in an order fixed by the sample and the backward config alone.

Padding: a query is real when its position q_start[b] + i lies in [kv_start[b], kv_end[b]).
Pad queries (left pad: they see no key; right pad: past kv_end) get dQ = 0 and contribute nothing
to dK/dV, whatever their incoming gradient: the backward treats their outputs as constants.
Pad keys get dK = dV = 0. With a KV cache (q_start > 0, Lq < Lk) the gradients are those of this
call: cached keys get the gradients of the queries present. A sliding window (``window`` > 0)
masks as the forward does; dQ walks the forward's blocks, and a key block's query tiles stop
past the last query whose window reaches it. Not causal (``causal=False``: self-attention, query i
is key i), every real query sees every real key: dK/dV's tiles walk all of the row's real queries
from kv_start, dQ all of its KV blocks. With attention sinks the LSE includes the sink, so P
is unchanged in form; a sink's gradient is -sum over its head's real queries of
exp(sink - LSE) * delta, summed in torch in one fixed order (batch, then position).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention import attention_forward, check_sinks
from .attention_state import first_window_block, in_window
from .configs import AttentionBackwardConfig, AttentionConfig, attention_backward_config, attention_config
from .launch import DOT_PRECISION, launch, reduction_rows
from .errors import InvalidArgumentError, InvalidDtypeError


@triton.jit(do_not_specialize=["rows"])
def _attention_bwd_delta_kernel(o_ptr, do_ptr, delta_ptr, rows, D,
                                BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """delta[r] = sum_d dO[r, d] * O[r, d] in fp32, for rows D elements apart."""
    offs_r = (tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_r[:, None] < rows) & (offs_d[None, :] < D)
    o = tl.load(o_ptr + offs_r[:, None] * D + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    do = tl.load(do_ptr + offs_r[:, None] * D + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(delta_ptr + offs_r, tl.sum(o * do, axis=1), mask=offs_r < rows)


@triton.jit
def _probabilities(q, kt, lse, visible, scale, DOT_PRECISION: tl.constexpr):
    """P [BM, BN] recomputed from q [BM, D], k^T [D, BN] and the rows' LSE; 0 where not visible."""
    s = tl.dot(q, kt, input_precision=DOT_PRECISION) * scale
    return tl.where(visible, tl.exp(s - lse[:, None]), 0.0)


@triton.jit(do_not_specialize=["Lq", "Lk", "window"])
def _attention_bwd_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, kv_start_ptr, kv_end_ptr, q_start_ptr,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_dom, stride_doh, stride_dod,
    Lq, Lk, Hq, Hkv, D, scale, window,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, TILES_FROM_KV_START: tl.constexpr, CAUSAL: tl.constexpr = True,
):
    """dK, dV [B, Hkv, Lk, D] (contiguous; zero-filled by the caller, so keys no program covers stay 0)."""
    pid_n = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // Hkv).to(tl.int64)
    kvh = bh % Hkv
    kv_start = tl.load(kv_start_ptr + b)
    kv_end = tl.load(kv_end_ptr + b)
    q_start = tl.load(q_start_ptr + b)

    n0 = kv_start + pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    in_seq = offs_n < kv_end
    kv_mask = in_seq[:, None] & (offs_d[None, :] < D)
    k = tl.load(k_ptr + b * stride_kb + kvh * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                mask=kv_mask, other=0.0)
    v = tl.load(v_ptr + b * stride_vb + kvh * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                mask=kv_mask, other=0.0)
    kt = tl.trans(k)
    vt = tl.trans(v)
    dk = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    # Queries that can see this block: positions in [max(n0, q_start), min(kv_end, q_start + Lq)),
    # (not causal: from the first real query), walked in tiles aligned to kv_start (tile boundaries
    # fixed by the sample, not the batch).
    if CAUSAL:
        first = tl.maximum(n0, q_start)
    else:
        first = tl.maximum(kv_start, q_start)
    if TILES_FROM_KV_START:
        origin = kv_start
    else:
        origin = q_start
    lo = origin + ((first - origin) // BLOCK_M) * BLOCK_M
    hi = tl.minimum(kv_end, q_start + Lq)
    hi = tl.where(window > 0, tl.minimum(hi, n0 + BLOCK_N - 1 + window), hi)  # no later query sees the block
    for g in range(GROUP):
        h = kvh * GROUP + g
        for p0 in range(lo, hi, BLOCK_M):
            pos = p0 + tl.arange(0, BLOCK_M)
            offs_m = pos - q_start
            real = (offs_m >= 0) & (offs_m < Lq) & (pos >= kv_start) & (pos < kv_end)
            row_mask = real[:, None] & (offs_d[None, :] < D)
            q = tl.load(q_ptr + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm
                        + offs_d[None, :] * stride_qd, mask=row_mask, other=0.0)
            do = tl.load(do_ptr + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dom
                         + offs_d[None, :] * stride_dod, mask=row_mask, other=0.0)
            lse = tl.load(lse_ptr + (b * Hq + h) * Lq + offs_m, mask=real, other=0.0)
            delta = tl.load(delta_ptr + (b * Lq + offs_m) * Hq + h, mask=real, other=0.0)
            visible = real[:, None] & in_seq[None, :]
            if CAUSAL:
                visible = visible & in_window(offs_n, pos, window)
            p = _probabilities(q, kt, lse, visible, scale, DOT_PRECISION)
            dv = tl.dot(tl.trans(p.to(do.dtype)), do, dv, input_precision=DOT_PRECISION)
            dp = tl.dot(do, vt, input_precision=DOT_PRECISION)
            ds = p * (dp - delta[:, None])
            dk = tl.dot(tl.trans(ds.to(q.dtype)), q, dk, input_precision=DOT_PRECISION)
    out = (b * Hkv + kvh) * Lk * D + offs_n[:, None] * D + offs_d[None, :]
    tl.store(dk_ptr + out, (dk * scale).to(dk_ptr.dtype.element_ty), mask=kv_mask)
    tl.store(dv_ptr + out, dv.to(dv_ptr.dtype.element_ty), mask=kv_mask)


@triton.jit(do_not_specialize=["Lq", "Lk", "window"])
def _attention_bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, kv_start_ptr, kv_end_ptr, q_start_ptr,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_dom, stride_doh, stride_dod,
    Lq, Lk, Hq, D, scale, window,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, CAUSAL: tl.constexpr = True,
):
    """dQ [B, Hq, Lq, D] (contiguous). Each query row's dQ is reduced from its own scores only."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // Hq).to(tl.int64)
    h = bh % Hq
    kvh = h // GROUP
    kv_start = tl.load(kv_start_ptr + b)
    kv_end = tl.load(kv_end_ptr + b)
    q_start = tl.load(q_start_ptr + b)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    pos = q_start + offs_m
    real = (offs_m < Lq) & (pos >= kv_start) & (pos < kv_end)
    row_mask = real[:, None] & (offs_d[None, :] < D)
    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                mask=row_mask, other=0.0)
    do = tl.load(do_ptr + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dom + offs_d[None, :] * stride_dod,
                 mask=row_mask, other=0.0)
    lse = tl.load(lse_ptr + (b * Hq + h) * Lq + offs_m, mask=real, other=0.0)
    delta = tl.load(delta_ptr + (b * Lq + offs_m) * Hq + h, mask=real, other=0.0)
    dq = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    # The forward's walk: blocks from kv_start up to the tile's last query (not causal: every real
    # key); a block a row cannot see adds exact zeros to that row.
    if CAUSAL:
        hi = tl.minimum(kv_end, q_start + tl.minimum((pid_m + 1) * BLOCK_M, Lq))
    else:
        hi = kv_end
    k_base = k_ptr + b * stride_kb + kvh * stride_kh
    v_base = v_ptr + b * stride_vb + kvh * stride_vh
    for n0 in range(first_window_block(kv_start, q_start + pid_m * BLOCK_M, window, BLOCK_N), hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        in_seq = (offs_n < kv_end) & (offs_n >= 0)
        kt = tl.load(k_base + offs_n[None, :] * stride_kn + offs_d[:, None] * stride_kd,
                     mask=in_seq[None, :] & (offs_d[:, None] < D), other=0.0)
        vt = tl.load(v_base + offs_n[None, :] * stride_vn + offs_d[:, None] * stride_vd,
                     mask=in_seq[None, :] & (offs_d[:, None] < D), other=0.0)
        visible = real[:, None] & in_seq[None, :]
        if CAUSAL:
            visible = visible & in_window(offs_n, pos, window)
        p = _probabilities(q, kt, lse, visible, scale, DOT_PRECISION)
        dp = tl.dot(do, vt, input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(kt.dtype), tl.trans(kt), dq, input_precision=DOT_PRECISION)
    out = (b * Hq + h) * Lq * D + offs_m[:, None] * D + offs_d[None, :]
    tl.store(dq_ptr + out, (dq * scale).to(dq_ptr.dtype.element_ty),
             mask=(offs_m[:, None] < Lq) & (offs_d[None, :] < D))


def attention_backward(grad_out, q, k, v, out, lse, kv_start, kv_end, q_start, scale,
                       config: AttentionConfig, backward_config: AttentionBackwardConfig,
                       need_dq: bool = True, need_dkdv: bool = True, window: int = 0, causal: bool = True):
    """(dQ, dK, dV) for ``grad_out`` [B, Lq, Hq, D], shaped as q, k, v (None where not needed).
    ``causal=False``: every real query sees every real key of its row (see ``attention_autograd``)."""
    B, Hq, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    dq = torch.empty((B, Hq, Lq, D), device=q.device, dtype=q.dtype)
    dk = torch.zeros((B, Hkv, Lk, D), device=k.device, dtype=k.dtype)
    dv = torch.zeros((B, Hkv, Lk, D), device=v.device, dtype=v.dtype)
    if B == 0 or Lq == 0 or Lk == 0:
        return dq.zero_(), dk, dv
    grad_out = grad_out.to(q.dtype)
    do_rows = reduction_rows(grad_out.reshape(-1, D))  # the delta sum's tree follows D alone
    do = do_rows.view(B, Lq, Hq, D)
    delta = torch.empty((B, Lq, Hq), device=q.device, dtype=torch.float32)
    rows = B * Lq * Hq
    block_d = max(16, triton.next_power_of_2(D))
    block_rows = backward_config.delta_rows
    launch(_attention_bwd_delta_kernel, (triton.cdiv(rows, block_rows),), q.device,
           reduction_rows(out.reshape(-1, D)), do_rows, delta, rows, D, BLOCK_ROWS=block_rows, BLOCK_D=block_d)
    common = (*q.stride(), *k.stride(), *v.stride(), *do.stride())
    ints = (kv_start, kv_end, q_start)
    cfg = backward_config
    if need_dkdv:
        launch(_attention_bwd_dkdv_kernel, (triton.cdiv(Lk, cfg.block_n), B * Hkv), q.device,
               q, k, v, do, lse, delta, dk, dv, *ints, *common, Lq, Lk, Hq, Hkv, D, scale, int(window),
               GROUP=Hq // Hkv, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=block_d,
               DOT_PRECISION=DOT_PRECISION, TILES_FROM_KV_START=cfg.tiles_from_kv_start, CAUSAL=causal,
               num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if need_dq:
        launch(_attention_bwd_dq_kernel, (triton.cdiv(Lq, config.block_m), B * Hq), q.device,
               q, k, v, do, lse, delta, dq, *ints, *common, Lq, Lk, Hq, D, scale, int(window),
               GROUP=Hq // Hkv, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_D=block_d,
               DOT_PRECISION=DOT_PRECISION, CAUSAL=causal, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return (dq if need_dq else None), (dk if need_dkdv else None), (dv if need_dkdv else None)


class AttentionFunction(torch.autograd.Function):
    """``attention`` with a batch-invariant, deterministic backward (see the module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, kv_start, kv_end, q_start, scale, config=None, backward_config=None, window=0,
                sinks=None, causal=True):
        B, Hq, Lq, D = q.shape
        cfg = config or attention_config(q.device.type, q.dtype, D)
        lse = torch.empty((B, Hq, Lq), device=q.device, dtype=torch.float32)
        if not causal:  # the forward's queries past every key; the backward's query i is key i
            q_start, forward_q_start = torch.zeros_like(kv_start), torch.full_like(kv_start, k.shape[2])
        else:
            forward_q_start = q_start
        out = attention_forward(q, k, v, kv_start, kv_end, forward_q_start, scale, cfg, lse=lse, window=window,
                                sinks=sinks)
        ctx.save_for_backward(q, k, v, out, lse, kv_start, kv_end, q_start, sinks)
        ctx.scale, ctx.config, ctx.window, ctx.causal = scale, cfg, window, causal
        ctx.backward_config = backward_config or attention_backward_config(q.device.type, q.dtype, D)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable  # no double backward: a clear error, not wrong grads
    def backward(ctx, grad_out):
        q, k, v, out, lse, kv_start, kv_end, q_start, sinks = ctx.saved_tensors
        need = ctx.needs_input_grad
        dq, dk, dv = attention_backward(grad_out, q, k, v, out, lse, kv_start, kv_end, q_start, ctx.scale,
                                        ctx.config, ctx.backward_config, need[0], need[1] or need[2], ctx.window,
                                        ctx.causal)
        dsinks = _sinks_grad(grad_out, out, lse, sinks, kv_start, kv_end, q_start) if need[10] else None
        return dq, dk, dv, None, None, None, None, None, None, None, dsinks, None


def _sinks_grad(grad_out, out, lse, sinks, kv_start, kv_end, q_start):
    """d sinks [Hq]: -sum over real queries of exp(sink - LSE) * rowsum(dO * O), in fp32."""
    B, Lq, Hq, _ = out.shape
    pos = q_start[:, None] + torch.arange(Lq, device=out.device)
    real = (pos >= kv_start[:, None]) & (pos < kv_end[:, None])                      # [B, Lq]
    delta = (grad_out.float() * out.float()).sum(-1)                                  # [B, Lq, Hq]
    p_sink = torch.exp(sinks.float()[None, :, None] - lse).transpose(1, 2)            # [B, Lq, Hq]
    return -(p_sink * delta * real[:, :, None]).sum((0, 1)).to(sinks.dtype)


def attention_autograd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       kv_start: torch.Tensor, kv_end: torch.Tensor, q_start: torch.Tensor,
                       scale: float, config: AttentionConfig | None = None, *,
                       backward_config: AttentionBackwardConfig | None = None, window: int = 0,
                       sinks: torch.Tensor | None = None, causal: bool = True) -> torch.Tensor:
    """``attention`` (same arguments, layout, result and bits) that autograd differentiates with
    the invariant backward. ``config`` (forward and dQ) and ``backward_config`` (dK/dV) override
    the fixed per-shape configs; pass them only to study configs (tests use them for a
    deliberately batch-dependent negative control). ``sinks`` [Hq] get their gradient too.

    ``causal=False`` (bidirectional self-attention, as encoders run it; Lq == Lk, no window): query i
    is key i of its row; a real one (i in [kv_start, kv_end)) sees every real key of its row. The
    forward is ``attention`` with every query placed past every key (q_start = Lk): its bits are those
    of the causal kernel run as non-causal. ``q_start`` is not read. Pad queries' outputs are
    constants to the backward, as in the causal mode."""
    B, Hq, Lq, D = q.shape
    if k.shape != v.shape or k.dim() != 4 or k.shape[0] != B or k.shape[3] != D or Hq % k.shape[1]:
        raise InvalidArgumentError(f"attention: incompatible q {tuple(q.shape)}, k {tuple(k.shape)}, v "
                                   f"{tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise InvalidDtypeError(f"attention: q/k/v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    check_sinks(sinks, Hq, q.device, "attention")
    if not causal and (window or Lq != k.shape[2]):
        raise InvalidArgumentError(f"attention: causal=False is bidirectional self-attention (Lq == Lk, no window); "
                                   f"got Lq {Lq}, Lk {k.shape[2]}, window {window}")
    return AttentionFunction.apply(q, k, v, kv_start, kv_end, q_start, scale, config, backward_config, window, sinks,
                                   causal)
