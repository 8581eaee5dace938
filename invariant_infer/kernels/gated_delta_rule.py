"""The gated delta rule (Gated DeltaNet's linear attention) as a chunked scan whose bits no batch,
chunking or cache changes.

Per value head, with q, k l2-normalised (q also scaled by dk^-0.5), g = -exp(A_log) *
softplus(a + dt_bias) <= 0 and beta = sigmoid(b), the state S [dk, dv] follows
    S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - exp(g_t) S_{t-1}^T k_t))^T,   o_t = S_t^T q_t.
The scan cuts each sequence into chunks of CHUNK tokens **from the sequence's first token**, and
computes a chunk from the state at its start (the boundary state) in the WY form (gamma: the chunk's
cumulative g; L: the strictly lower beta_i (k_i . k_j) exp(gamma_i - gamma_j); T = (I + L)^-1, by
forward substitution in 16 x 16 diagonal blocks merged pairwise, ``triangular_inverse``):
    w = T (beta k exp(gamma)),  u = T (beta v),  v_new = u - w S,
    o = (q exp(gamma)) S + causal(q k^T exp(gamma_i - gamma_j)) v_new,
    S' = S exp(gamma_last) + (k exp(gamma_last - gamma))^T v_new     (complete chunks only).
Row i of every product depends on rows 0 .. i of its chunk alone (every sum over the chunk in a
fixed order, with exact zeros past row i). So a chunk holding
only its first t + 1 rows gives row t the bits the complete chunk gives it: a decode step, or a
prefill cut anywhere, is the same computation over "the rows since the boundary state". Callers keep
each sequence's boundary state and the inputs of its unfinished chunk, and run the rows since the
boundary again with the new ones appended (``chunk_gated_delta_rule``'s segments start at a
boundary). The state and every accumulation are fp32. The products run on tensor cores, their fp32
operands split into bf16 parts (``split_precision_dot``): bf16x6 (fp32's accuracy) for those with v
and for q k^T, bf16x3 for the rest, whose error the output and state damp.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .errors import InvalidArgumentError, InvalidDtypeError
from .configs import tile_device
from .launch import launch
from .split_precision_dot import dot_bf16x3, dot_bf16x6
from .triangular_inverse import unit_lower_inverse

CHUNK = 64  # tokens per chunk: fixed, never chosen from the batch or the sequence lengths
SUB = 16  # the diagonal blocks of the triangular solve, inverted row by row
NUM_WARPS = 8  # sm_90 at 128 x 64 state tiles: 4 warps spill, and ptxas takes 3x as long


@triton.jit
def _l2_normalize(x):
    """Each row of an fp32 [rows, D] block over its own norm (eps 1e-6 inside the root, as HF's l2norm)."""
    return x / tl.sqrt(tl.sum(x * x, axis=1) + 1e-6)[:, None]


@triton.jit(do_not_specialize=["num_segments"])
def _chunk_gated_delta_rule_kernel(
    q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, out_ptr, state_ptr, seg_start_ptr, seg_end_ptr,
    out_from_ptr, num_segments, Hv, Dk, Dv, scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_at, stride_bt, stride_ot, stride_oh,
    GROUP: tl.constexpr, CHUNK: tl.constexpr, SUB: tl.constexpr, MERGES: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    seg = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    kh = h // GROUP  # consecutive value heads share a key head
    start = tl.load(seg_start_ptr + seg).to(tl.int64)
    end = tl.load(seg_end_ptr + seg).to(tl.int64)
    out_from = tl.load(out_from_ptr + seg).to(tl.int64)

    r = tl.arange(0, CHUNK)
    dk = tl.arange(0, BLOCK_K)
    dv = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    k_mask, v_mask = dk < Dk, dv < Dv
    state_base = state_ptr + (seg.to(tl.int64) * Hv + h) * Dk * Dv
    state_offs = dk[:, None] * Dv + dv[None, :]
    state_mask = k_mask[:, None] & v_mask[None, :]
    state = tl.load(state_base + state_offs, mask=state_mask, other=0.0)
    neg_decay_rate = -tl.exp(tl.load(a_log_ptr + h).to(tl.float32))
    dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)
    causal = r[:, None] >= r[None, :]
    strictly_lower = r[:, None] > r[None, :]

    for c0 in range(start, end, CHUNK):
        rows = c0 + r
        valid = rows < end
        q = tl.load(q_ptr + rows[:, None] * stride_qt + kh * stride_qh + dk[None, :],
                    mask=valid[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        k = tl.load(k_ptr + rows[:, None] * stride_kt + kh * stride_kh + dk[None, :],
                    mask=valid[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        v = tl.load(v_ptr + rows[:, None] * stride_vt + h * stride_vh + dv[None, :],
                    mask=valid[:, None] & v_mask[None, :], other=0.0).to(tl.float32)
        a = tl.load(a_ptr + rows * stride_at + h, mask=valid, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + rows * stride_bt + h, mask=valid, other=0.0).to(tl.float32)
        q = _l2_normalize(q) * scale
        k = _l2_normalize(k)
        x = a + dt_bias
        softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))  # torch's threshold
        g = tl.where(valid, neg_decay_rate * softplus, 0.0)
        beta = tl.where(valid, 1.0 / (1.0 + tl.exp(-b)), 0.0)
        gamma = tl.cumsum(g, axis=0)
        pair = tl.where(causal, tl.exp(tl.where(causal, gamma[:, None] - gamma[None, :], 0.0)), 0.0)  # <= 1

        # Products on tensor cores: bf16x6 (fp32's accuracy) where the values reach the state or the
        # output at full weight (the products with v, and q k^T); bf16x3 where its 2^-16 is damped
        # (measured against float64 per product: docs/how-it-works.md).
        k_beta = k * beta[:, None]
        kk = dot_bf16x3(k_beta, tl.trans(k), tl.zeros((CHUNK, CHUNK), tl.float32))
        lower = tl.where(strictly_lower & valid[:, None] & valid[None, :], kk * pair, 0.0)
        inverse = unit_lower_inverse(lower, CHUNK, SUB, MERGES)
        w = dot_bf16x3(inverse, k_beta * tl.exp(gamma)[:, None], tl.zeros((CHUNK, BLOCK_K), tl.float32))
        u = dot_bf16x6(inverse, v * beta[:, None], tl.zeros((CHUNK, BLOCK_V), tl.float32))
        v_new = u - dot_bf16x3(w, state, tl.zeros((CHUNK, BLOCK_V), tl.float32))

        qk = dot_bf16x6(q, tl.trans(k), tl.zeros((CHUNK, CHUNK), tl.float32))
        attend = tl.where(valid[:, None] & valid[None, :], qk * pair, 0.0)
        out = dot_bf16x3(q * tl.exp(gamma)[:, None], state, tl.zeros((CHUNK, BLOCK_V), tl.float32))
        out = dot_bf16x6(attend, v_new, out)
        store = valid & (rows >= out_from)
        tl.store(out_ptr + rows[:, None] * stride_ot + h * stride_oh + dv[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=store[:, None] & v_mask[None, :])

        if c0 + CHUNK <= end:  # a complete chunk moves the boundary state
            last = tl.sum(tl.where(r == CHUNK - 1, gamma, 0.0), axis=0)
            k_decayed = k * tl.exp(last - gamma)[:, None]
            state = dot_bf16x6(tl.trans(k_decayed), v_new, state * tl.exp(last))
    tl.store(state_base + state_offs, state, mask=state_mask)


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                           a_log: torch.Tensor, dt_bias: torch.Tensor, seg_start: torch.Tensor,
                           seg_end: torch.Tensor, state: torch.Tensor, out_from: torch.Tensor | None = None,
                           block_v: int | None = None, chunk: int = CHUNK) -> torch.Tensor:
    """The gated delta rule over packed segments.

    q, k: [T, Hk, Dk] (before l2norm); v: [T, Hv, Dv]; a, b: [T, Hv] (the ``in_proj_a`` / ``in_proj_b``
    outputs); a_log, dt_bias: [Hv]. Segment s is tokens [seg_start[s], seg_end[s]) (int32 [S]), which
    begin at a chunk boundary of their sequence; ``state`` [S, Hv, Dk, Dv] fp32 holds each segment's
    boundary state and is overwritten with the state after its last complete chunk. ``out_from``
    (int32 [S], default ``seg_start``): the first token whose output is written (the rows before it
    were run before, and are run again only to rebuild their chunk). Returns out [T, Hv, Dv] in v's
    dtype; rows outside every segment's output range are zero. ``block_v`` splits Dv over programs
    (it changes no bit); ``chunk`` other than CHUNK is for tests' negative controls."""
    tokens, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    if k.shape != q.shape or v.shape[0] != tokens or hv % hk or a.shape != (tokens, hv) or b.shape != (tokens, hv):
        raise InvalidArgumentError(f"chunk_gated_delta_rule: incompatible q {tuple(q.shape)}, k {tuple(k.shape)}, "
                                   f"v {tuple(v.shape)}, a {tuple(a.shape)}, b {tuple(b.shape)}")
    segments = seg_start.shape[0]
    if state.shape != (segments, hv, dk, dv) or state.dtype != torch.float32 or not state.is_contiguous():
        raise InvalidArgumentError(f"chunk_gated_delta_rule: state must be contiguous fp32 {(segments, hv, dk, dv)}, "
                                   f"got {tuple(state.shape)} {state.dtype}")
    if not q.dtype == k.dtype == v.dtype:
        raise InvalidDtypeError(f"chunk_gated_delta_rule: q/k/v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    q, k, v, a, b = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v, a, b))
    out = torch.zeros((tokens, hv, dv), device=v.device, dtype=v.dtype)
    if segments == 0 or tokens == 0:
        return out
    block_k = max(16, triton.next_power_of_2(dk))
    block_v = block_v or launch_block_v(v.device, dv)
    out_from = seg_start if out_from is None else out_from
    grid = (segments, hv, triton.cdiv(dv, block_v))
    launch(_chunk_gated_delta_rule_kernel, grid, v.device,
           q, k, v, a, b, a_log, dt_bias, out, state, seg_start, seg_end, out_from, segments, hv, dk, dv, dk ** -0.5,
           q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), a.stride(0), b.stride(0),
           out.stride(0), out.stride(1),
           GROUP=hv // hk, CHUNK=chunk, SUB=min(SUB, chunk), MERGES=(chunk // min(SUB, chunk)).bit_length() - 1,
           BLOCK_K=block_k, BLOCK_V=block_v,
           num_warps=NUM_WARPS, num_stages=1)
    return out


def launch_block_v(device: torch.device, dv: int) -> int:
    """Dv per program: all of it in the interpreter (its cost is per program), at most 64 on CUDA."""
    block = max(16, triton.next_power_of_2(dv))
    return block if tile_device(device.type) == "cpu" else min(block, 64)
