"""Bytes moved and FLOPs of each kernel kind of the plan report, from the shapes alone (bf16: 2
bytes an element). The formulas are written out in ``benchmarks.plan``'s docstring."""
from __future__ import annotations

from dataclasses import dataclass

ELEMENT = 2  # bytes of a bf16 element
GDN_CHUNK = 64


@dataclass(frozen=True)
class Cost:
    bytes: float
    flops: float


def gemm_cost(m: int, n: int, k: int, inputs: int = 1) -> Cost:
    """x [M, K] (``inputs`` of them: 2 for a fused silu * up prologue) @ W[N, K]^T -> [M, N]."""
    return Cost(ELEMENT * (inputs * m * k + n * k + m * n), 2 * m * n * k)


def grouped_gemm_cost(rows: int, n: int, k: int, experts: int) -> Cost:
    """``rows`` routed rows over ``experts`` experts' [N, K] weights: min(E, rows) weights read."""
    return Cost(ELEMENT * (rows * k + min(experts, rows) * n * k + rows * n), 2 * rows * n * k)


def elementwise_cost(rows: int, n: int) -> Cost:
    """act(gate) * up over [rows, n]: two inputs read, one output written, ~16 FLOPs an element."""
    return Cost(ELEMENT * 3 * rows * n, 16 * rows * n)


def rms_norm_cost(rows: int, n: int) -> Cost:
    return Cost(ELEMENT * (2 * rows * n + n), 4 * rows * n)


def rms_norm_backward_cost(rows: int, n: int) -> Cost:
    """d x and d weight: x and dy read, d x written; the 64-row groups' fp32 sums written and read."""
    groups = -(-rows // 64)
    return Cost(ELEMENT * (3 * rows * n + 2 * n) + 2 * 4 * groups * n, 10 * rows * n)


def attention_prefill_cost(m: int, heads: int, kv_heads: int, d: int, window: int = 0) -> Cost:
    """Causal attention of one sequence of M tokens: M (M + 1) / 2 visible pairs, each query seeing
    at most ``window`` keys when windowed."""
    if window and window < m:
        pairs = window * (window + 1) // 2 + (m - window) * window
    else:
        pairs = m * (m + 1) // 2
    return Cost(ELEMENT * (2 * m * heads * d + 2 * m * kv_heads * d), 4 * heads * d * pairs)


def attention_decode_cost(batch: int, context: int, heads: int, kv_heads: int, d: int, window: int = 0) -> Cost:
    keys = min(context, window) if window else context
    return Cost(ELEMENT * (2 * batch * keys * kv_heads * d + 2 * batch * heads * d), 4 * batch * heads * d * keys)


def gated_delta_rule_cost(tokens: int, key_heads: int, value_heads: int, dk: int, dv: int) -> Cost:
    flops = tokens * value_heads * (6 * dk * dv + 2 * GDN_CHUNK * (dk + dv))
    moved = ELEMENT * tokens * (2 * key_heads * dk + 2 * value_heads * dv + 2 * value_heads) + 8 * value_heads * dk * dv
    return Cost(moved, flops)
