"""fp32 products on tensor cores: each fp32 operand split into a sum of bf16 numbers, whose pairwise
products a bf16 MMA computes exactly (8-bit mantissas) and sums in fp32.

  * ``dot_bf16x3``: hi = bf16(x), lo = bf16(x - hi), so x = hi + lo within 2^-17 |x|;
    a b ~ hi_a hi_b + hi_a lo_b + lo_a hi_b: three MMAs, about 2^-16 relative per product (one
    bf16 MMA: 2^-8);
  * ``dot_bf16x6``: three-way splits (x = hi + mid + lo within 2^-26 |x|) and the six products
    down to 2^-18: fp32's own accuracy, at the cost of three tf32 MMAs (tf32x3 reaches only
    about 2^-21, measured worse than fp32 on the gated delta rule's state).
The splits are explicit, so the CPU interpreter (whose harness widens bf16 exactly, rounds fp32 ->
bf16 to nearest even and sums each element over k in one order) computes the algorithm the GPU
runs. The products are added into ``acc`` in one fixed order, the smallest first. Operands may be
2-D or batched 3-D.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def split_bf16(x):
    """(hi, lo) in bf16 with hi + lo = x within 2^-17 |x| (x fp32)."""
    hi = x.to(tl.bfloat16)
    lo = (x - hi.to(tl.float32)).to(tl.bfloat16)
    return hi, lo


@triton.jit
def split_bf16_3(x):
    """(hi, mid, lo) in bf16 with hi + mid + lo = x within 2^-26 |x| (each difference is exact in fp32)."""
    hi = x.to(tl.bfloat16)
    rest = x - hi.to(tl.float32)
    mid = rest.to(tl.bfloat16)
    return hi, mid, (rest - mid.to(tl.float32)).to(tl.bfloat16)


@triton.jit
def dot_bf16x3(a, b, acc):
    """acc + a @ b for fp32 a, b by three bf16 tensor-core products (fp32 accumulation)."""
    a_hi, a_lo = split_bf16(a)
    b_hi, b_lo = split_bf16(b)
    acc = tl.dot(a_lo, b_hi, acc)
    acc = tl.dot(a_hi, b_lo, acc)
    return tl.dot(a_hi, b_hi, acc)


@triton.jit
def dot_bf16x6(a, b, acc):
    """acc + a @ b for fp32 a, b by six bf16 tensor-core products of three-way splits (the terms
    down to 2^-18 of the product; the dropped ones are below 2^-25): fp32's accuracy."""
    a_hi, a_mid, a_lo = split_bf16_3(a)
    b_hi, b_mid, b_lo = split_bf16_3(b)
    acc = tl.dot(a_lo, b_hi, acc)
    acc = tl.dot(a_hi, b_lo, acc)
    acc = tl.dot(a_mid, b_mid, acc)
    acc = tl.dot(a_mid, b_hi, acc)
    acc = tl.dot(a_hi, b_mid, acc)
    return tl.dot(a_hi, b_hi, acc)
