"""The online-softmax state of attention rows, shared by every attention kernel so that each
reduces in exactly the same order: a KV block's update, a KV chunk's merge, and the finish.

A row's state is (m, l, acc): its running max score, its denominator rescaled to m, and its
output numerator [D], all fp32. A chunk's state starts empty (m = -inf, l = 0, acc = 0) and takes
the chunk's blocks in order (``online_softmax_block``); the chunk states of a row merge into its
total in ascending chunk order (``merge_chunk_state``); ``finish_rows`` adds the sink and divides.
"""
from __future__ import annotations

import triton
import triton.language as tl


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
def merge_chunk_state(m_i, l_i, acc, m_c, l_c, acc_c):
    """The row totals (m, l, acc) with one more chunk's state merged in, per row. A chunk with no
    visible key for a row (m_c = -inf) leaves that row's total exactly as it was, and the first
    chunk merged into an empty total (m_i = -inf) becomes the total exactly: both are selected,
    never rescaled. Explicit fmas fix the expression whatever FMA contraction the compiler does,
    so the sequential kernels and the parallel schedule's combine kernel compute the same bits."""
    m_new = tl.maximum(m_i, m_c)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    beta = tl.exp(m_c - m_safe)
    l_new = tl.fma(l_c, beta, l_i * alpha)
    acc_new = tl.fma(acc_c, beta[:, None], acc * alpha[:, None])
    keep = m_c == float("-inf")
    take = m_i == float("-inf")
    l_new = tl.where(keep, l_i, tl.where(take, l_c, l_new))
    acc_new = tl.where(keep[:, None], acc, tl.where(take[:, None], acc_c, acc_new))
    return m_new, l_new, acc_new


@triton.jit
def finish_rows(m_i, l_i, acc, sink, HAS_SINKS: tl.constexpr):
    """(out [BM, D], m, l) after the last chunk: with a sink, exp(sink) joins each row's denominator
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
def row_lse(m_i, l_i):
    """Each row's log-sum-exp of its scaled scores (and sink) from its finished state; -inf for a
    row that sees no key (the backward's input)."""
    return tl.where(l_i > 0, m_i + tl.log(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))


@triton.jit
def first_window_block(kv_start, first_query, window, BLOCK_N: tl.constexpr):
    """Start of the first KV block (blocks aligned to kv_start) that holds a key the query at
    ``first_query`` sees with a sliding window of ``window`` keys (0: no window, every block)."""
    skip = tl.maximum(first_query - window + 1 - kv_start, 0) // BLOCK_N * BLOCK_N
    return kv_start + tl.where(window > 0, skip, 0)


@triton.jit
def first_chunk(kv_start, lo, KV_CHUNK: tl.constexpr):
    """Start of the first chunk (chunks aligned to kv_start) a walk from block ``lo`` merges: the one
    holding lo, or, when lo is below index 0 (keys an evicting cache no longer holds, never read),
    the one holding index 0: every chunk wholly below 0 is empty, and an empty chunk merges as
    the identity."""
    first = tl.maximum(lo, 0)
    return kv_start + (first - kv_start) // KV_CHUNK * KV_CHUNK


@triton.jit
def in_window(offs_n, q_pos, window):
    """[BM, BN]: key offs_n is causal for query q_pos and, with a window, one of its last ``window``."""
    causal = offs_n[None, :] <= q_pos[:, None]
    return causal & ((offs_n[None, :] > q_pos[:, None] - window) | (window == 0))
