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

Split-KV: each row's keys are also cut into chunks of a fixed SIZE ``kv_chunk`` (a multiple
of BLOCK_N, from the config, never from the batch, Lk or the number of SMs), counted from
kv_start like the blocks. Each chunk's online softmax starts from the empty state; the chunk
states merge in ascending chunk order (``attention_state.merge_chunk_state``), then the sink
and acc / l. Decode and prefill reduce with the same chunks: a decode row's last chunk stops at
its own position, and the blocks and chunks prefill walks past it are fully masked for it (a
masked block and an empty chunk change nothing). Whether the chunks of a (query tile, head) run in
sequence in one program or in parallel programs whose states a combine kernel merges is a
schedule (``attention_split``): it never moves a bit. Chunks wholly before a tile's first window
are skipped (empty for every row of the tile).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention_split import (check_kv_chunk, chunk_count, chunk_workspace, combine_chunks, parallel_chunks_pay,
                              store_chunk_state, workspace_bytes)
from .attention_state import (finish_rows, first_chunk, first_window_block, in_window, merge_chunk_state,
                              online_softmax_block, row_lse)
from .configs import AttentionConfig, attention_config
from .launch import DOT_PRECISION, launch
from .errors import InvalidArgumentError, InvalidDtypeError


@triton.jit(do_not_specialize=["Lq", "Lk", "window"])
def _attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, sinks_ptr, kv_start_ptr, kv_end_ptr, q_start_ptr,
    m_ws_ptr, l_ws_ptr, acc_ws_ptr,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_om, stride_oh, stride_od,
    Lq, Lk, Hq, D, scale, window,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    KV_CHUNK: tl.constexpr, DOT_PRECISION: tl.constexpr, STORE_LSE: tl.constexpr = False,
    HAS_SINKS: tl.constexpr = False, PARALLEL_CHUNKS: tl.constexpr = False,
):
    """Sequential: one program per (query tile, row and head) merges every chunk and stores the
    output. PARALLEL_CHUNKS: program_id(2) = j computes the tile's j-th chunk alone and stores its
    state in the workspace [chunks, B, Lq, Hq] (acc: [..., D]) for ``combine_chunks``."""
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
    chunk_lo = first_chunk(kv_start, lo, KV_CHUNK)
    if PARALLEL_CHUNKS:  # this program's one chunk (past hi: an empty state, stored all the same)
        chunk_lo += tl.program_id(2) * KV_CHUNK
        chunk_hi = chunk_lo + KV_CHUNK
    else:
        chunk_hi = hi
    k_base = k_ptr + b * stride_kb + kvh * stride_kh
    v_base = v_ptr + b * stride_vb + kvh * stride_vh
    for c0 in range(chunk_lo, chunk_hi, KV_CHUNK):
        m_c = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_c = tl.zeros((BLOCK_M,), tl.float32)
        acc_c = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
        for n0 in range(tl.maximum(c0, lo), tl.minimum(c0 + KV_CHUNK, hi), BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            in_seq = (offs_n < kv_end) & (offs_n >= 0)
            k = tl.load(k_base + offs_n[None, :] * stride_kn + offs_d[:, None] * stride_kd,
                        mask=in_seq[None, :] & (offs_d[:, None] < D), other=0.0)
            v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                        mask=in_seq[:, None] & (offs_d[None, :] < D), other=0.0)
            visible = in_seq[None, :] & in_window(offs_n, q_pos, window)
            m_c, l_c, acc_c = online_softmax_block(q, k, v, visible, m_c, l_c, acc_c, scale, DOT_PRECISION)
        m_i, l_i, acc = merge_chunk_state(m_i, l_i, acc, m_c, l_c, acc_c)
    if PARALLEL_CHUNKS:
        state = ((tl.program_id(2) * (tl.num_programs(1) // Hq) + b) * Lq + offs_m) * Hq + h  # [chunk, b, i, h]
        store_chunk_state(m_ws_ptr, l_ws_ptr, acc_ws_ptr, state, offs_m < Lq, offs_d, D, m_i, l_i, acc)
    else:
        # Rows with no visible key (left-pad queries) give 0, never NaN.
        sink = tl.load(sinks_ptr + h).to(tl.float32) if HAS_SINKS else 0.0
        out, m_i, l_i = finish_rows(m_i, l_i, acc, sink, HAS_SINKS)
        tl.store(o_ptr + b * stride_ob + offs_m[:, None] * stride_om + h * stride_oh + offs_d[None, :] * stride_od,
                 out.to(o_ptr.dtype.element_ty), mask=(offs_m[:, None] < Lq) & (offs_d[None, :] < D))
        if STORE_LSE:  # for the backward only: lse [B, Hq, Lq] fp32, -inf for a row that sees no key
            tl.store(lse_ptr + (b * Hq + h) * Lq + offs_m, row_lse(m_i, l_i), mask=offs_m < Lq)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              kv_start: torch.Tensor, kv_end: torch.Tensor, q_start: torch.Tensor,
              scale: float, config: AttentionConfig | None = None, window: int = 0,
              sinks: torch.Tensor | None = None, parallel_chunks: bool | None = None) -> torch.Tensor:
    """Causal GQA attention.

    q: [B, Hq, Lq, D]; k, v: [B, Hkv, Lk, D] (not repeated); kv_start, kv_end, q_start: int32 [B].
    ``window`` > 0: a sliding window of that many keys (see the module docstring); ``sinks``: one
    logit per query head [Hq] added to each row's softmax denominator (any float dtype).
    Returns [B, Lq, Hq, D], contiguous. ``config`` overrides the fixed per-shape config
    (tests use it for a negative control); ``parallel_chunks`` forces the KV chunks' schedule
    (tests; the bits are the same), by default ``attention_split.parallel_chunks_pay`` picks it."""
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
    return attention_forward(q, k, v, kv_start, kv_end, q_start, scale, config, window=window, sinks=sinks,
                             parallel_chunks=parallel_chunks)


def check_sinks(sinks: torch.Tensor | None, heads: int, device: torch.device, name: str) -> None:
    if sinks is not None and (sinks.shape != (heads,) or sinks.device != device or not sinks.is_floating_point()):
        raise InvalidArgumentError(f"{name}: sinks must be a float tensor [Hq] = [{heads}] on {device}, got "
                                   f"{sinks.dtype} {tuple(sinks.shape)} on {sinks.device}")


def attention_forward(q, k, v, kv_start, kv_end, q_start, scale, config=None, lse=None, window: int = 0,
                      sinks=None, parallel_chunks: bool | None = None):
    """``attention`` without the argument checks; with ``lse`` (fp32 [B, Hq, Lq], contiguous) it
    also stores each query row's log-sum-exp of its scaled scores (and its sink) there (the
    backward's input)."""
    B, Hq, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    cfg = config or attention_config(q.device.type, q.dtype, D)
    check_kv_chunk(cfg, "attention")
    out = torch.empty((B, Lq, Hq, D), device=q.device, dtype=q.dtype)
    if B == 0 or Lq == 0:
        return out
    tiles = (triton.cdiv(Lq, cfg.block_m), B * Hq)
    chunks = chunk_count(Lk, cfg.kv_chunk)
    if parallel_chunks is None:
        parallel_chunks = parallel_chunks_pay(q.device, tiles[0] * tiles[1], triton.cdiv(Lk, cfg.kv_chunk),
                                              workspace_bytes(chunks, B * Lq * Hq, D))
    m_ws = l_ws = acc_ws = out
    if parallel_chunks:
        m_ws, l_ws, acc_ws = chunk_workspace(chunks, (B, Lq, Hq), D, q.device)
    launch(
        _attention_kernel, (*tiles, chunks) if parallel_chunks else tiles, q.device,
        q, k, v, out, out if lse is None else lse, out if sinks is None else sinks, kv_start, kv_end, q_start,
        m_ws, l_ws, acc_ws,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        Lq, Lk, Hq, D, scale, int(window),
        GROUP=Hq // Hkv, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=max(16, triton.next_power_of_2(D)),
        KV_CHUNK=cfg.kv_chunk, DOT_PRECISION=DOT_PRECISION, STORE_LSE=lse is not None and not parallel_chunks,
        HAS_SINKS=sinks is not None and not parallel_chunks, PARALLEL_CHUNKS=bool(parallel_chunks),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if parallel_chunks:
        combine_chunks(m_ws, l_ws, acc_ws, out, lse, sinks, B, Lq, Hq, D, out.stride(),
                       None if lse is None else (Hq * Lq, Lq))
    return out
