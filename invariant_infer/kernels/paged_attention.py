"""Paged, variable-length causal GQA attention for a serving engine, bitwise equal to ``attention``.

An engine packs the scheduled tokens of S sequences into one unpadded batch of T queries and
keeps K/V in a paged cache. For every query token this kernel returns exactly the bits that
``attention()`` (invariant_infer/kernels/attention.py) computes for that token when its sequence runs in a
padded batch, with any padding, as full prefill, chunked prefill or decode. So an engine step
gets the logits ``model(...)`` gets. What makes it so:

* Same tiles. BLOCK_M, BLOCK_N come from the same ``attention_config(device, dtype, head_dim)``,
  BLOCK_D = max(16, next_pow2(D)), the same ``input_precision`` (``launch.DOT_PRECISION``)
  and the same num_warps / num_stages, so every ``tl.dot`` is the same instruction with the same
  summation order.
* Same blocks. Sequence position 0 is page 0 offset 0, and KV block j covers positions
  [j*BLOCK_N, (j+1)*BLOCK_N): aligned to the sequence's first token exactly as the padded kernel
  aligns its blocks to kv_start. A page holds a whole number of blocks (page_size is a multiple
  of BLOCK_N; the engine uses page_size == BLOCK_N), so a page never splits a block.
* Same chunks. KV chunk c covers positions [c*kv_chunk, (c+1)*kv_chunk) (kv_chunk from the
  same config, a multiple of BLOCK_N), as the padded kernel counts its chunks from kv_start.
* Same arithmetic in the same order. Both kernels update each block with one shared function,
  ``attention_state.online_softmax_block`` (scores, -inf masking, m, alpha, p, l, acc), merge
  each chunk's state into the row's total with ``attention_state.merge_chunk_state`` in chunk
  order, and finish with ``attention_state.finish_rows`` (a sink, if any, then acc / l). The
  chunks run in one program or in parallel programs merged by a combine kernel
  (``attention_split``): a schedule, the same bits. The online softmax
  of a query row uses only that row's scores, so which other rows share its tile (other
  queries of its sequence, or tile tails past its chunk) never changes it.
* Same walk. A query tile holds BLOCK_M consecutive queries of ONE sequence. It walks blocks
  0 .. the last position its last query can see, like ``hi`` in the padded kernel. A walk may
  stop earlier or later than the padded kernel's for the same row (chunks and tiles differ),
  but only by blocks that lie wholly past the row's own position: those are fully masked for
  it and leave its m, l, acc bit-for-bit unchanged (alpha = 1, p = 0, v finite). Keys past
  seq_len (a chunk's future, unwritten slots) load as 0, as the padded kernel's out-of-row keys
  do; they are masked anyway, and 0 * v = 0 exactly.

Queries of sequence s are rows query_starts[s]:query_starts[s+1] of q; with q_len(s) of them,
they sit at absolute positions seq_lens[s] - q_len(s) .. seq_lens[s] - 1 and see keys
0 .. own position. A prefill chunk writes its K/V (``write_kv``) before attending, so all
keys < seq_lens[s] are in the cache.

GQA reads the shared KV head (h // group). Offsets that can pass 2**31 elements (page * page
stride, token * token stride) are int64. The batch-dependent integer arguments are not
specialized, so CUDA compiles one kernel for any batch.

What the caller (the engine) must guarantee, unchecked on the device (no host sync):
  * 0 <= q_len(s) <= seq_lens[s], query_starts non-decreasing, query_starts[S] == T;
  * max_query_len >= every q_len(s) (tiles past it are never launched: those rows stay unset);
  * max_seq_len, when given, >= every seq_lens[s] (the parallel schedule launches no chunk past it);
  * block_tables[s, j] is a valid page for j < cdiv(seq_lens[s], page_size); entries past a
    sequence's last page are never read, so any filler (0) is fine there;
  * K/V of positions 0 .. seq_lens[s] - 1 are in those pages (write this step's first);
  * no two live positions share a slot.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention import check_sinks
from .attention_split import (check_kv_chunk, chunk_workspace, combine_chunks, parallel_chunks_pay,
                              store_chunk_state, workspace_bytes)
from .attention_state import (finish_rows, first_chunk, first_window_block, in_window, merge_chunk_state,
                              online_softmax_block)
from .configs import AttentionConfig, attention_config
from .launch import DOT_PRECISION, launch
from .errors import InvalidArgumentError, InvalidDtypeError


@triton.jit(do_not_specialize=["stride_bts", "stride_btp", "window", "T"])
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, sinks_ptr, query_starts_ptr, seq_lens_ptr, block_tables_ptr,
    m_ws_ptr, l_ws_ptr, acc_ws_ptr,
    stride_qt, stride_qh, stride_qd,
    stride_kp, stride_ko, stride_kh, stride_kd,
    stride_vp, stride_vo, stride_vh, stride_vd,
    stride_ot, stride_oh, stride_od,
    stride_bts, stride_btp,
    T, Hq, D, scale, window,
    GROUP: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, KV_CHUNK: tl.constexpr,
    DOT_PRECISION: tl.constexpr, HAS_SINKS: tl.constexpr = False, PARALLEL_CHUNKS: tl.constexpr = False,
):
    """Sequential: one program per (query tile, sequence and head) merges every chunk and stores
    the output. PARALLEL_CHUNKS: program_id(2) = j computes the tile's j-th chunk alone and stores
    its state in the workspace [chunks, T, Hq] (acc: [..., D]) for ``combine_chunks``."""
    pid_m = tl.program_id(0)
    sh = tl.program_id(1)
    s = sh // Hq
    h = sh % Hq
    kvh = h // GROUP  # GQA: read the shared KV head, never a repeated copy
    q_begin = tl.load(query_starts_ptr + s)
    q_len = tl.load(query_starts_ptr + s + 1) - q_begin
    seq_len = tl.load(seq_lens_ptr + s)
    if pid_m * BLOCK_M >= q_len:  # the grid covers the longest chunk; this sequence's is shorter
        return
    q_start = seq_len - q_len  # absolute position of the sequence's first query in this step

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    rows = (q_begin + offs_m).to(tl.int64)  # token offsets can pass 2**31 elements
    q = tl.load(q_ptr + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :] * stride_qd,
                mask=(offs_m[:, None] < q_len) & (offs_d[None, :] < D), other=0.0)
    q_pos = q_start + offs_m

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    # Walk blocks up to the tile's last query (hi <= seq_len: no page past the sequence's last
    # one is looked up); blocks past a row's own limit leave its m, l, acc bit-for-bit unchanged.
    hi = tl.minimum(seq_len, q_start + tl.minimum((pid_m + 1) * BLOCK_M, q_len))
    lo = first_window_block(0, q_start + pid_m * BLOCK_M, window, BLOCK_N)
    chunk_lo = first_chunk(0, lo, KV_CHUNK)
    if PARALLEL_CHUNKS:  # this program's one chunk (past hi: an empty state, stored all the same)
        chunk_lo += tl.program_id(2) * KV_CHUNK
        chunk_hi = chunk_lo + KV_CHUNK
    else:
        chunk_hi = hi
    table = block_tables_ptr + s.to(tl.int64) * stride_bts
    k_head = k_ptr + kvh * stride_kh
    v_head = v_ptr + kvh * stride_vh
    for c0 in range(chunk_lo, chunk_hi, KV_CHUNK):
        m_c = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_c = tl.zeros((BLOCK_M,), tl.float32)
        acc_c = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
        for n0 in range(tl.maximum(c0, lo), tl.minimum(c0 + KV_CHUNK, hi), BLOCK_N):
            page = tl.load(table + (n0 // PAGE_SIZE) * stride_btp).to(tl.int64)  # page * stride can pass 2**31
            in_page = (n0 % PAGE_SIZE) + tl.arange(0, BLOCK_N)
            offs_n = n0 + tl.arange(0, BLOCK_N)
            in_seq = offs_n < seq_len
            k = tl.load(k_head + page * stride_kp + in_page[None, :] * stride_ko + offs_d[:, None] * stride_kd,
                        mask=in_seq[None, :] & (offs_d[:, None] < D), other=0.0)
            v = tl.load(v_head + page * stride_vp + in_page[:, None] * stride_vo + offs_d[None, :] * stride_vd,
                        mask=in_seq[:, None] & (offs_d[None, :] < D), other=0.0)
            visible = in_seq[None, :] & in_window(offs_n, q_pos, window)
            m_c, l_c, acc_c = online_softmax_block(q, k, v, visible, m_c, l_c, acc_c, scale, DOT_PRECISION)
        m_i, l_i, acc = merge_chunk_state(m_i, l_i, acc, m_c, l_c, acc_c)
    if PARALLEL_CHUNKS:
        state = (tl.program_id(2) * T + rows) * Hq + h  # [chunk, token, head]
        store_chunk_state(m_ws_ptr, l_ws_ptr, acc_ws_ptr, state, offs_m < q_len, offs_d, D, m_i, l_i, acc)
    else:
        # A row with no visible key (none here: every query sees itself) would give 0, never NaN.
        sink = tl.load(sinks_ptr + h).to(tl.float32) if HAS_SINKS else 0.0
        out = finish_rows(m_i, l_i, acc, sink, HAS_SINKS)[0]
        tl.store(o_ptr + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :] * stride_od,
                 out.to(o_ptr.dtype.element_ty), mask=(offs_m[:, None] < q_len) & (offs_d[None, :] < D))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    query_starts: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                    scale: float, *, max_query_len: int, config: AttentionConfig | None = None,
                    window: int = 0, sinks: torch.Tensor | None = None, max_seq_len: int | None = None,
                    parallel_chunks: bool | None = None) -> torch.Tensor:
    """Causal GQA attention of packed queries over a paged KV cache.

    q: [T, Hq, D], the queries of S sequences packed back to back (sequence s owns rows
    query_starts[s]:query_starts[s+1]); k_cache, v_cache: [num_pages, page_size, Hkv, D] with
    page_size a multiple of the config's block_n (the engine uses block_n); query_starts: int32
    [S + 1]; seq_lens: int32 [S], each sequence's context length including this step's queries;
    block_tables: int32 [S, max_pages], page j of sequence s holding its positions
    [j * page_size, (j + 1) * page_size); max_query_len: a host int >= every sequence's query
    count (sizes the grid); ``window`` > 0: a sliding window of that many keys, the blocks
    ``attention`` walks and skips for it; ``sinks`` [Hq]: attention sinks, as ``attention``'s.
    ``max_seq_len``: a host int >= every seq_lens[s], or None; it sizes the parallel schedule's
    grid of KV chunks, so without it the chunks run in sequence. Returns [T, Hq, D] in q's dtype,
    contiguous. ``config`` overrides the fixed per-shape config (tests use it for a negative
    control); bitwise equality with ``attention`` holds for the default one, which ``attention``
    also uses. ``parallel_chunks`` forces the KV chunks' schedule (tests; the bits are the same),
    by default ``attention_split.parallel_chunks_pay`` picks it."""
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise InvalidArgumentError("paged_attention: expected q [T, Hq, D] and caches [pages, page_size, Hkv, D], "
                                   f"got q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, v_cache "
                                   f"{tuple(v_cache.shape)}")
    T, Hq, D = q.shape
    _, page_size, Hkv, _ = k_cache.shape
    if k_cache.shape[3] != D or Hq % Hkv:
        raise InvalidArgumentError(f"paged_attention: incompatible q {tuple(q.shape)} and k_cache "
                                   f"{tuple(k_cache.shape)}")
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise InvalidDtypeError(f"paged_attention: q/k_cache/v_cache dtypes differ: {q.dtype}, {k_cache.dtype}, "
                                f"{v_cache.dtype}")
    S = seq_lens.shape[0]
    if seq_lens.dim() != 1 or query_starts.shape != (S + 1,) or block_tables.dim() != 2 \
            or block_tables.shape[0] != S:
        raise InvalidArgumentError("paged_attention: expected seq_lens [S], query_starts [S + 1], block_tables [S, "
                                   f"pages], got {tuple(seq_lens.shape)}, {tuple(query_starts.shape)}, "
                                   f"{tuple(block_tables.shape)}")
    for name, t in (("query_starts", query_starts), ("seq_lens", seq_lens), ("block_tables", block_tables)):
        if t.dtype != torch.int32:
            raise InvalidDtypeError(f"paged_attention: {name} must be int32, got {t.dtype}")
        if t.device != q.device:
            raise InvalidArgumentError(f"paged_attention: {name} is on {t.device}, q on {q.device}")
    if window < 0:
        raise InvalidArgumentError(f"paged_attention: window must be 0 (none) or positive, got {window}")
    check_sinks(sinks, Hq, q.device, "paged_attention")
    cfg = config or attention_config(q.device.type, q.dtype, D)
    if page_size % cfg.block_n:
        raise InvalidArgumentError(f"paged_attention: page_size {page_size} is not a multiple of the KV block "
                                   f"{cfg.block_n}: a page would split a block")
    check_kv_chunk(cfg, "paged_attention")
    if parallel_chunks and max_seq_len is None:
        raise InvalidArgumentError("paged_attention: parallel_chunks needs max_seq_len (the grid's bound on the "
                                   "KV chunks)")
    out = torch.empty((T, Hq, D), device=q.device, dtype=q.dtype)
    if T == 0 or S == 0 or max_query_len <= 0:
        return out
    grid = (triton.cdiv(max_query_len, cfg.block_m), S * Hq)
    chunks = 1 if max_seq_len is None else triton.cdiv(max(max_seq_len, 1), cfg.kv_chunk)
    if parallel_chunks is None:
        parallel_chunks = parallel_chunks_pay(q.device, grid[0] * grid[1], chunks, workspace_bytes(chunks, T * Hq, D))
    m_ws = l_ws = acc_ws = out
    if parallel_chunks:
        m_ws, l_ws, acc_ws = chunk_workspace(chunks, (1, T, Hq), D, q.device)
    launch(
        _paged_attention_kernel, (*grid, chunks) if parallel_chunks else grid, q.device,
        q, k_cache, v_cache, out, out if sinks is None else sinks, query_starts, seq_lens, block_tables,
        m_ws, l_ws, acc_ws,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *out.stride(), *block_tables.stride(),
        T, Hq, D, scale, int(window),
        GROUP=Hq // Hkv, PAGE_SIZE=page_size,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=max(16, triton.next_power_of_2(D)), KV_CHUNK=cfg.kv_chunk,
        DOT_PRECISION=DOT_PRECISION, HAS_SINKS=sinks is not None and not parallel_chunks,
        PARALLEL_CHUNKS=bool(parallel_chunks), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if parallel_chunks:
        combine_chunks(m_ws, l_ws, acc_ws, out, None, sinks, 1, T, Hq, D, (0, *out.stride()), None)
    return out


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store this step's keys and values in the paged cache, exactly (a plain indexed copy).

    k, v: [T, Hkv, D]; k_cache, v_cache: [num_pages, page_size, Hkv, D], each page's tokens
    contiguous (pages may be strided apart); slot_mapping: int [T], token t's
    slot page * page_size + offset. Slots must be distinct and in range."""
    if k.shape != v.shape or k_cache.shape != v_cache.shape or k.dim() != 3 or k_cache.dim() != 4 \
            or k.shape[1:] != k_cache.shape[2:] or slot_mapping.shape != (k.shape[0],):
        raise InvalidArgumentError(f"write_kv: incompatible k {tuple(k.shape)}, v {tuple(v.shape)}, k_cache "
                                   f"{tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}, slot_mapping "
                                   f"{tuple(slot_mapping.shape)}")
    if not (k.dtype == v.dtype == k_cache.dtype == v_cache.dtype):
        raise InvalidDtypeError(f"write_kv: dtypes differ: k {k.dtype}, v {v.dtype}, k_cache {k_cache.dtype}, v_cache "
                                f"{v_cache.dtype} (a cast here would change the bits attention reads)")
    slots = slot_mapping.long()
    _, page_size, Hkv, D = k_cache.shape
    page_contiguous = k_cache.stride()[1:] == (Hkv * D, D, 1) and v_cache.stride() == k_cache.stride()
    if page_contiguous and k_cache.stride(0) != page_size * k_cache.stride(1):  # pages holding more (kv_cache_layout)
        pages, offsets = slots // page_size, slots % page_size
        k_cache[pages, offsets] = k
        v_cache[pages, offsets] = v
        return
    # view (never reshape): a copy would swallow the writes.
    k_cache.view(-1, Hkv, D).index_copy_(0, slots, k)
    v_cache.view(-1, Hkv, D).index_copy_(0, slots, v)
