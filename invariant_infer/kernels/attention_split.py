"""Split-KV attention: the fixed chunk tree, its merge, and the two schedules that compute it.

A row's keys are cut into chunks of ``AttentionConfig.kv_chunk`` keys (a multiple of BLOCK_N)
counted from the row's first key (kv_start; position 0 in the paged cache). Each chunk's online
softmax state (m, l, acc) starts empty and walks the chunk's blocks with
``attention_state.online_softmax_block``; the chunk states are merged into the row's total in
ascending chunk order with ``attention_state.merge_chunk_state``; then the sink and acc / l
(``attention_state.finish_rows``).
The tree is fixed by the row's own positions, so padding, the batch and Lq never move it.

Two schedules compute that tree with the same bits:
  * sequential: one program per (query tile, head) walks every chunk and merges in registers
    (the interpreter's schedule, and the GPU's when the tiles alone fill the SMs);
  * parallel: one program per (query tile, head, chunk) writes its chunk's fp32 state to a
    workspace, and ``_split_kv_combine_kernel`` merges them in chunk order with the same
    function, then applies the sink and writes the output (and the log-sum-exp).
``parallel_chunks_pay`` picks the schedule from the SM count, the programs and the chunk count;
the reduction tree never depends on it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention_state import finish_rows, merge_chunk_state, row_lse
from .configs import AttentionConfig, tile_device
from .errors import InvalidArgumentError
from .launch import launch
from .linear import _sm_count

# The parallel schedule's fp32 workspace holds every chunk's state for every row; past this the
# sequential schedule runs instead (a schedule choice: the bits are the same).
MAX_WORKSPACE_BYTES = 256 << 20


@triton.jit
def store_chunk_state(m_ptr, l_ptr, acc_ptr, state, rows, offs_d, D, m, l, acc):
    """Write rows' chunk state into the workspace: m, l at ``state``, acc at ``state * D + d``."""
    tl.store(m_ptr + state, m, mask=rows)
    tl.store(l_ptr + state, l, mask=rows)
    tl.store(acc_ptr + state[:, None] * D + offs_d[None, :], acc, mask=rows[:, None] & (offs_d[None, :] < D))


@triton.jit
def load_chunk_state(m_ptr, l_ptr, acc_ptr, state, rows, offs_d, D):
    """The chunk state ``store_chunk_state`` wrote; rows outside ``rows`` read as an empty chunk."""
    m = tl.load(m_ptr + state, mask=rows, other=float("-inf"))
    l = tl.load(l_ptr + state, mask=rows, other=0.0)
    acc = tl.load(acc_ptr + state[:, None] * D + offs_d[None, :], mask=rows[:, None] & (offs_d[None, :] < D),
                  other=0.0)
    return m, l, acc


@triton.jit(do_not_specialize=["Lq", "chunks"])
def _split_kv_combine_kernel(
    m_ptr, l_ptr, acc_ptr, o_ptr, lse_ptr, sinks_ptr,
    stride_wc, stride_wb, stride_wm, stride_wh,
    stride_ob, stride_om, stride_oh, stride_od,
    stride_lb, stride_lh,
    Lq, Hq, D, chunks,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, STORE_LSE: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    """Rows (b, i < Lq) of head h: merge chunk states 0 .. chunks - 1 in order, finish, store.
    m, l: [chunks, ...] at stride_w*; acc: the same strides times D, then d contiguous."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // Hq).to(tl.int64)
    h = bh % Hq
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    rows = offs_m < Lq
    state = b * stride_wb + offs_m.to(tl.int64) * stride_wm + h * stride_wh
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    for c in range(0, chunks):  # always chunk 0, 1, 2, ... in that order
        m_c, l_c, acc_c = load_chunk_state(m_ptr, l_ptr, acc_ptr, c * stride_wc + state, rows, offs_d, D)
        m_i, l_i, acc = merge_chunk_state(m_i, l_i, acc, m_c, l_c, acc_c)
    sink = tl.load(sinks_ptr + h).to(tl.float32) if HAS_SINKS else 0.0
    out, m_i, l_i = finish_rows(m_i, l_i, acc, sink, HAS_SINKS)
    tl.store(o_ptr + b * stride_ob + offs_m[:, None] * stride_om + h * stride_oh + offs_d[None, :] * stride_od,
             out.to(o_ptr.dtype.element_ty), mask=rows[:, None] & (offs_d[None, :] < D))
    if STORE_LSE:
        tl.store(lse_ptr + b * stride_lb + h * stride_lh + offs_m, row_lse(m_i, l_i), mask=rows)


def check_kv_chunk(config: AttentionConfig, name: str) -> None:
    if config.kv_chunk <= 0 or config.kv_chunk % config.block_n:
        raise InvalidArgumentError(f"{name}: kv_chunk {config.kv_chunk} is not a positive multiple of the KV block "
                                   f"{config.block_n}")


def chunk_count(keys: int, kv_chunk: int) -> int:
    """An upper bound on the chunks one query tile merges when its keys span ``keys`` indices: the
    first chunk may start up to kv_chunk - 1 below index 0 (a window's partial first chunk)."""
    return triton.cdiv(keys, kv_chunk) + 1


def parallel_chunks_pay(device: torch.device, programs: int, chunks: int, workspace_bytes: int) -> bool:
    """The schedule (never the arithmetic): run the chunks in parallel on a GPU when the
    (query tile, head) programs alone would leave SMs idle (decode, short prefill at small batch)
    and the longest row has more than one chunk (``chunks``: its key count over kv_chunk, rounded
    up). The interpreter runs them in sequence."""
    if chunks <= 1 or tile_device(device.type) != "cuda" or workspace_bytes > MAX_WORKSPACE_BYTES:
        return False
    return programs < _sm_count(device)


def chunk_workspace(chunks: int, shape: tuple[int, ...], head_dim: int, device: torch.device):
    """fp32 (m, l, acc) for every chunk of every (row..., head): [chunks, *shape] and [chunks, *shape, D]."""
    m = torch.empty((chunks, *shape), device=device, dtype=torch.float32)
    return m, torch.empty_like(m), torch.empty((chunks, *shape, head_dim), device=device, dtype=torch.float32)


def workspace_bytes(chunks: int, rows: int, head_dim: int) -> int:
    return chunks * rows * (head_dim + 2) * 4


def combine_chunks(m, l, acc, out, lse, sinks, batch: int, rows: int, heads: int, head_dim: int,
                   out_strides, lse_strides) -> None:
    """Merge the workspace's chunk states of ``batch`` x ``rows`` x ``heads`` rows into ``out``.
    m, l: [chunks, batch, rows, heads] contiguous; out_strides: (batch, row, head, d);
    lse_strides: (batch, head) of an fp32 [batch, heads, rows] (rows contiguous) or None."""
    block_m = 16
    launch(
        _split_kv_combine_kernel, (triton.cdiv(rows, block_m), batch * heads), out.device,
        m, l, acc, out, out if lse is None else lse, out if sinks is None else sinks,
        *m.stride(), *out_strides, *(lse_strides or (0, 0)),
        rows, heads, head_dim, m.shape[0],
        BLOCK_M=block_m, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        STORE_LSE=lse is not None, HAS_SINKS=sinks is not None,
    )
