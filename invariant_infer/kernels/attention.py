"""Batch-invariant causal GQA attention (prefill and decode share one code path).

Each row b has real keys in [kv_start[b], kv_end[b]); query i sits at absolute position
q_start[b] + i and sees keys j <= that position. KV blocks have a fixed size BLOCK_N and
start at kv_start[b], so the amount or side of padding never moves a block boundary, and a
decode step (Lq = 1) walks exactly the blocks prefill walked for the same row. The online
softmax is updated per query row only from that row's own scores, so the other rows in a
tile, and how many query rows there are, never change a row's arithmetic.

Decode (Lq = 1, or a few tokens) is this same kernel with the same BLOCK_M and BLOCK_N: a
tile shape change could change the MMA instruction, and with it the summation order, so
neither may depend on Lq. Its keys come from the cache (dynamic or static; a static cache's
unused tail lies after the query's position, so the causal mask hides it), so a decode
step's bits equal those of the prefill row at the same position.

A sliding window of W keys (``window`` > 0) lets the query at position p see keys p - W + 1 .. p
only. The blocks stay where they are, aligned to kv_start; a tile starts its walk at the block
holding its first query's first visible key, so blocks wholly before every window of the tile are
skipped, and a block no row of the tile can see changes no row. A cache that evicts keys (a
sliding-window cache keeps the last W - 1) shifts the key indices: the caller then passes
kv_start, kv_end and q_start as indices into the keys it holds, kv_start possibly negative (the
evicted first token's index), so every block boundary stays at the same absolute position; keys
below index 0 are never read.

Future flash-decoding (split-KV) must keep this contract: split each row's keys into chunks
of a fixed SIZE (a multiple of BLOCK_N, starting at kv_start), never a fixed COUNT chosen
from the batch, Lk or the number of SMs; reduce each chunk with this online softmax and
merge the chunks' (m, l, acc) in ascending chunk order. A chunk merge is not bitwise a
continuation of the online softmax, so prefill must then reduce with the same chunks (one
split-aware kernel serving both), or decode would no longer equal prefill.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .configs import AttentionConfig, attention_config
from .launch import DOT_PRECISION, launch
from .errors import InvalidArgumentError, InvalidDtypeError


@triton.jit
def online_softmax_block(q, k, v, visible, m_i, l_i, acc, scale, DOT_PRECISION: tl.constexpr):
    """One KV block of the online softmax, each query row of the tile updated from its own scores.
    q [BM, D], k [D, BN], v [BN, D], visible [BM, BN]; returns the new (m, l, acc). The padded and
    the paged kernel both call this, so they reduce in exactly the same order. A block with no
    visible key for a row leaves that row's m, l, acc bit-for-bit unchanged (alpha = 1, p = 0)."""
    s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.where(m_new > m_i, tl.exp(m_i - m_safe), 1.0)
    p = tl.exp(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def finish_rows(m_i, l_i, acc, sink, HAS_SINKS: tl.constexpr):
    """(out [BM, D], m, l) after the last block: with a sink, exp(sink) joins each row's denominator
    (rescaled to the new max, as one more block); then acc / l. A row with no visible key and no
    sink gives 0, never NaN; with a sink it gives 0 too (acc = 0)."""
    if HAS_SINKS:
        m_new = tl.maximum(m_i, sink)
        alpha = tl.where(m_new > m_i, tl.exp(m_i - m_new), 1.0)
        l_i = l_i * alpha + tl.exp(sink - m_new)
        acc = acc * alpha[:, None]
        m_i = m_new
    return acc / tl.where(l_i > 0, l_i, 1.0)[:, None], m_i, l_i


@triton.jit
def first_window_block(kv_start, first_query, window, BLOCK_N: tl.constexpr):
    """Start of the first KV block (blocks aligned to kv_start) that holds a key the query at
    ``first_query`` sees with a sliding window of ``window`` keys (0: no window, every block)."""
    skip = tl.maximum(first_query - window + 1 - kv_start, 0) // BLOCK_N * BLOCK_N
    return kv_start + tl.where(window > 0, skip, 0)


@triton.jit
def in_window(offs_n, q_pos, window):
    """[BM, BN]: key offs_n is causal for query q_pos and, with a window, one of its last ``window``."""
    causal = offs_n[None, :] <= q_pos[:, None]
    return causal & ((offs_n[None, :] > q_pos[:, None] - window) | (window == 0))


@triton.jit(do_not_specialize=["Lq", "Lk", "window"])
def _attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, sinks_ptr, kv_start_ptr, kv_end_ptr, q_start_ptr,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_om, stride_oh, stride_od,
    Lq, Lk, Hq, D, scale, window,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, STORE_LSE: tl.constexpr = False, HAS_SINKS: tl.constexpr = False,
):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // Hq).to(tl.int64)  # batch offsets can pass 2**31 elements (long static caches)
    h = bh % Hq
    kvh = h // GROUP  # GQA: read the shared KV head, never a repeated copy
    kv_start = tl.load(kv_start_ptr + b)
    kv_end = tl.load(kv_end_ptr + b)
    q_start = tl.load(q_start_ptr + b)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                mask=(offs_m[:, None] < Lq) & (offs_d[None, :] < D), other=0.0)
    q_pos = q_start + offs_m

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    # Walk blocks up to the tile's last query; blocks past a row's own limit are fully masked
    # for that row and leave its m, l, acc bit-for-bit unchanged (alpha = 1, p = 0).
    hi = tl.minimum(kv_end, q_start + tl.minimum((pid_m + 1) * BLOCK_M, Lq))
    lo = first_window_block(kv_start, q_start + pid_m * BLOCK_M, window, BLOCK_N)
    k_base = k_ptr + b * stride_kb + kvh * stride_kh
    v_base = v_ptr + b * stride_vb + kvh * stride_vh
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        in_seq = (offs_n < kv_end) & (offs_n >= 0)
        k = tl.load(k_base + offs_n[None, :] * stride_kn + offs_d[:, None] * stride_kd,
                    mask=in_seq[None, :] & (offs_d[:, None] < D), other=0.0)
        v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                    mask=in_seq[:, None] & (offs_d[None, :] < D), other=0.0)
        visible = in_seq[None, :] & in_window(offs_n, q_pos, window)
        m_i, l_i, acc = online_softmax_block(q, k, v, visible, m_i, l_i, acc, scale, DOT_PRECISION)
    # Rows with no visible key (left-pad queries) give 0, never NaN.
    sink = tl.load(sinks_ptr + h).to(tl.float32) if HAS_SINKS else 0.0
    out, m_i, l_i = finish_rows(m_i, l_i, acc, sink, HAS_SINKS)
    tl.store(o_ptr + b * stride_ob + offs_m[:, None] * stride_om + h * stride_oh + offs_d[None, :] * stride_od,
             out.to(o_ptr.dtype.element_ty), mask=(offs_m[:, None] < Lq) & (offs_d[None, :] < D))
    if STORE_LSE:  # for the backward only: lse [B, Hq, Lq] fp32, -inf for a row that sees no key
        lse = tl.where(l_i > 0, m_i + tl.log(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + (b * Hq + h) * Lq + offs_m, lse, mask=offs_m < Lq)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              kv_start: torch.Tensor, kv_end: torch.Tensor, q_start: torch.Tensor,
              scale: float, config: AttentionConfig | None = None, window: int = 0,
              sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal GQA attention.

    q: [B, Hq, Lq, D]; k, v: [B, Hkv, Lk, D] (not repeated); kv_start, kv_end, q_start: int32 [B].
    ``window`` > 0: a sliding window of that many keys (see the module docstring); ``sinks``: one
    logit per query head [Hq] added to each row's softmax denominator (any float dtype).
    Returns [B, Lq, Hq, D], contiguous. ``config`` overrides the fixed per-shape config
    (tests use it for a negative control)."""
    B, Hq, Lq, D = q.shape
    _, Hkv, Lk, _ = k.shape
    if k.shape != v.shape or k.shape[0] != B or k.shape[3] != D or Hq % Hkv:
        raise InvalidArgumentError(f"attention: incompatible q {tuple(q.shape)}, k {tuple(k.shape)}, v "
                                   f"{tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise InvalidDtypeError(f"attention: q/k/v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if window < 0:
        raise InvalidArgumentError(f"attention: window must be 0 (none) or positive, got {window}")
    check_sinks(sinks, Hq, q.device, "attention")
    return attention_forward(q, k, v, kv_start, kv_end, q_start, scale, config, window=window, sinks=sinks)


def check_sinks(sinks: torch.Tensor | None, heads: int, device: torch.device, name: str) -> None:
    if sinks is not None and (sinks.shape != (heads,) or sinks.device != device or not sinks.is_floating_point()):
        raise InvalidArgumentError(f"{name}: sinks must be a float tensor [Hq] = [{heads}] on {device}, got "
                                   f"{sinks.dtype} {tuple(sinks.shape)} on {sinks.device}")


def attention_forward(q, k, v, kv_start, kv_end, q_start, scale, config=None, lse=None, window: int = 0,
                      sinks=None):
    """``attention`` without the argument checks; with ``lse`` (fp32 [B, Hq, Lq], contiguous) it
    also stores each query row's log-sum-exp of its scaled scores (and its sink) there (the
    backward's input)."""
    B, Hq, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    cfg = config or attention_config(q.device.type, q.dtype, D)
    out = torch.empty((B, Lq, Hq, D), device=q.device, dtype=q.dtype)
    if B == 0 or Lq == 0:
        return out
    grid = (triton.cdiv(Lq, cfg.block_m), B * Hq)
    launch(
        _attention_kernel, grid, q.device,
        q, k, v, out, out if lse is None else lse, out if sinks is None else sinks, kv_start, kv_end, q_start,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        Lq, Lk, Hq, D, scale, int(window),
        GROUP=Hq // Hkv, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=max(16, triton.next_power_of_2(D)),
        DOT_PRECISION=DOT_PRECISION, STORE_LSE=lse is not None, HAS_SINKS=sinks is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out
