"""(I + L)^-1 of a strictly lower-triangular [CHUNK, CHUNK] block (the gated delta rule's WY form), on
tensor cores and blocked, so that row i depends on rows 0 .. i of L alone, in one order for any
number of rows.

  1. The SUB x SUB diagonal blocks, as a batch [CHUNK / SUB, SUB, SUB], each inverted by forward
     substitution in fp32 on the CUDA cores: row i from rows 0 .. i - 1 of its block, SUB x SUB
     multiply-adds per row and block (not a CHUNK x CHUNK x CHUNK product per row).
  2. Inverted blocks merged pairwise up to the whole chunk: [[T11, 0], [L21, T22]] -> its lower-left
     block -T22 L21 T11.
The merges' products are ``dot_bf16x3`` (three bf16 MMAs, fp32 accumulation). Every sum runs over
whole blocks in an order fixed by the shapes, with exact zeros outside the triangle, so a row's
sums never see a later row's values.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .split_precision_dot import dot_bf16x3


@triton.jit
def unit_lower_inverse(lower, CHUNK: tl.constexpr, SUB: tl.constexpr, MERGES: tl.constexpr):
    BLOCKS: tl.constexpr = CHUNK // SUB
    s = tl.arange(0, SUB)
    b = tl.arange(0, BLOCKS)
    same_block = b[:, None] == b[None, :]                                   # [BLOCKS, BLOCKS]
    # The diagonal blocks: one nonzero term per sum (x + 0 is x), so they are L's values exactly.
    blocks4 = tl.reshape(lower, (BLOCKS, SUB, BLOCKS, SUB))
    diagonal = tl.sum(tl.where(same_block[:, None, :, None], blocks4, 0.0), axis=2)  # [BLOCKS, SUB, SUB]
    eye = (s[:, None] == s[None, :]).to(tl.float32)
    inverse = tl.zeros((BLOCKS, SUB, SUB), tl.float32) + eye[None, :, :]
    for i in tl.static_range(1, SUB):
        row = (s == i)[None, :, None]
        l_row = tl.sum(tl.where(row, diagonal, 0.0), axis=1)                     # [BLOCKS, SUB]: L[i, :]
        # Row i: e_i - sum_j L[i, j] T[j, :], over j = 0 .. SUB - 1 (zeros from j = i on).
        solved = tl.sum(l_row[:, :, None] * inverse, axis=1)
        inverse = tl.where(row, eye[None, :, :] - solved[:, None, :], inverse)
    # Back to [CHUNK, CHUNK], block-diagonal.
    spread = tl.broadcast_to(tl.reshape(inverse, (BLOCKS, SUB, 1, SUB)), (BLOCKS, SUB, BLOCKS, SUB))
    full = tl.reshape(tl.where(same_block[:, None, :, None], spread, 0.0), (CHUNK, CHUNK))
    r = tl.arange(0, CHUNK)
    tl.static_assert(MERGES <= 2, "CHUNK is at most 4 SUB blocks")
    if MERGES > 0:
        full = _merge_blocks(lower, full, r, SUB, CHUNK)
    if MERGES > 1:
        full = _merge_blocks(lower, full, r, 2 * SUB, CHUNK)
    return full


@triton.jit
def _merge_blocks(lower, inverse, r, SIZE: tl.constexpr, CHUNK: tl.constexpr):
    """Pairs of inverted SIZE x SIZE diagonal blocks into one of 2 SIZE: its lower-left block
    -T22 L21 T11 (``inverse`` is block-diagonal in SIZE blocks, so the whole-chunk products
    pick T11 and T22 by their zeros)."""
    pair = (r[:, None] // (2 * SIZE)) == (r[None, :] // (2 * SIZE))
    below = pair & ((r[:, None] // SIZE) % 2 == 1) & ((r[None, :] // SIZE) % 2 == 0)
    zeros = tl.zeros((CHUNK, CHUNK), tl.float32)
    corner = dot_bf16x3(tl.where(below, lower, 0.0), inverse, zeros)
    return tl.where(below, -dot_bf16x3(inverse, corner, zeros), inverse)
