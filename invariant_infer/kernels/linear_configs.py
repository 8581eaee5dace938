"""The GEMM tile and K tree of a weight shape, by rule: a function of (dtype, N, K), never of M.

A ``LinearConfig`` fixes the reduction order of every output element: K is cut into ``k_chunks``
chunks of ``chunk_k`` (the last one may be shorter), each chunk summed from zero in BLOCK_K steps,
the chunk sums added in chunk order. The rest of the config is schedule: whether the chunks run in
parallel (split-K, small M) or in sequence in one program (large M) never moves a bit.

The GPU rule (``gpu_linear_config``), in words:
  * tiles: BLOCK_M 128 and BLOCK_K 64 for 16-bit types, with the widest BLOCK_N (128, 64, 32, 16)
    whose output tiles times the chunks K allows fill TARGET_PROGRAMS at M <= 128 (one row tile):
    8 warps and 3 stages at 128 x 128 and 128 x 64 (96 and 72 KiB of shared memory, within sm_89's
    99 KiB; 8 warps hold the sequential schedule's two accumulators, the chunk's and the total's,
    without spilling), 4 warps and 4 stages below. fp32: 64 x (64, 32 or 16) x 32, 3 stages (48 KiB
    at most). A launch with the silu prologue (an up tile beside each x tile) pipelines fewer stages
    where these would pass the budget (``linear.pipeline_stages``): stages never reorder a sum.
  * K chunks: none when the output tiles alone fill TARGET_PROGRAMS; otherwise enough chunks that
    tiles x chunks >= TARGET_PROGRAMS, each at least MIN_CHUNK_STEPS BLOCK_Ks long (so that the fp32
    partial sums, M x N x 4 bytes a chunk, stay a fraction of the weight bytes the chunk reads), of
    equal length where a length in range divides K, else the last one shorter.
TARGET_PROGRAMS is a constant, an H100 SXM's SM count, never the device's: the tree must be the same
on every GPU. Row-parallel layers (tensor parallelism splits their K) cut K first into
``tree_leaves(K)`` leaves, then each leaf into equal chunks (``gpu_row_parallel_config``), so that a
rank's shard is whole chunks at every TP size dividing the leaves.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton

TARGET_PROGRAMS = 132  # programs a small-M GEMM should launch: one wave of an H100 SXM's SMs
MIN_CHUNK_STEPS = 2    # BLOCK_K steps a K chunk holds at least (where K has them)
MIN_CHUNK_K = 128      # K a chunk holds at least, for GEMMs whose steps are scale groups (quantized)
TREE_LEAVES = 8        # the most leaves of a row-parallel layer's K tree
MIN_BLOCK_K = 16       # tl.dot's smallest K


@dataclass(frozen=True)
class LinearConfig:
    block_m: int
    block_n: int
    block_k: int
    k_chunks: int = 1   # the reduction tree: K cut into this many chunks, summed in order
    chunk_k: int = 0    # K per chunk; 0: ceil(K / BLOCK_K / k_chunks) BLOCK_Ks (see chunk_length)
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3


def _gpu_tiles(dtype: torch.dtype) -> list[LinearConfig]:
    """The candidate tiles, widest first, with their warps and stages (no K tree yet)."""
    if dtype == torch.float32:
        return [LinearConfig(64, 64, 32), LinearConfig(64, 32, 32), LinearConfig(64, 16, 32)]
    return [LinearConfig(128, 128, 64, num_warps=8, num_stages=3), LinearConfig(128, 64, 64, num_warps=8, num_stages=3),
            LinearConfig(128, 32, 64, num_warps=4, num_stages=4), LinearConfig(128, 16, 64, num_warps=4, num_stages=4)]


def chunk_steps(tiles: int, steps: int, min_steps: int = MIN_CHUNK_STEPS) -> int:
    """Steps per K chunk for ``tiles`` output tiles over K of ``steps`` steps: all of them (one
    chunk) when the tiles fill TARGET_PROGRAMS, else the longest chunk (at least ``min_steps``) that
    gives tiles x chunks >= TARGET_PROGRAMS, preferring a length that divides ``steps`` (equal
    chunks). The rule every GEMM's K tree follows (linear's steps are BLOCK_Ks, the quantized
    GEMMs' whole scale groups)."""
    if tiles >= TARGET_PROGRAMS:
        return steps
    longest = max(min_steps, steps // triton.cdiv(TARGET_PROGRAMS, tiles))
    return next((s for s in range(longest, min_steps - 1, -1) if steps % s == 0), longest)


def _plain_tree(tile: LinearConfig, n: int, k: int) -> LinearConfig:
    """``tile`` with the K chunks of a plain layer (``chunk_steps`` in BLOCK_Ks)."""
    steps = triton.cdiv(k, tile.block_k)
    length = chunk_steps(triton.cdiv(n, tile.block_n), steps)
    chunks = triton.cdiv(steps, length)
    return tile if chunks == 1 else replace(tile, k_chunks=chunks, chunk_k=length * tile.block_k)


def _leaf_tree(tile: LinearConfig, n: int, k: int, leaves: int) -> LinearConfig:
    """``tile`` with K cut into ``leaves`` equal leaves, each cut into the fewest equal chunks (a
    whole number of MIN_BLOCK_Ks, at least MIN_CHUNK_STEPS BLOCK_Ks where the leaf has them) that
    reach TARGET_PROGRAMS, or the most such chunks when none does."""
    leaf = k // leaves
    needed = triton.cdiv(TARGET_PROGRAMS, triton.cdiv(n, tile.block_n) * leaves)
    shortest = min(leaf, MIN_CHUNK_STEPS * tile.block_k)
    splits = [s for s in range(1, leaf // MIN_BLOCK_K + 1) if leaf % (s * MIN_BLOCK_K) == 0 and leaf // s >= shortest]
    per_leaf = next((s for s in splits if s >= needed), splits[-1])
    return replace(tile, k_chunks=leaves * per_leaf, chunk_k=leaf // per_leaf)


def _programs(cfg: LinearConfig, n: int) -> int:
    return triton.cdiv(n, cfg.block_n) * cfg.k_chunks


def _widest_filling(trees: list[LinearConfig], n: int) -> LinearConfig:
    """The first (widest) config that fills TARGET_PROGRAMS at small M, else the one that comes closest."""
    return next((cfg for cfg in trees if _programs(cfg, n) >= TARGET_PROGRAMS),
                max(trees, key=lambda cfg: _programs(cfg, n)))


def gpu_linear_config(dtype: torch.dtype, n: int, k: int) -> LinearConfig:
    """The GPU config of an [N, K] weight (see the module's docstring)."""
    return _widest_filling([_plain_tree(tile, n, k) for tile in _gpu_tiles(dtype)], n)


def tree_leaves(k: int) -> int:
    """Leaves of the K tree for a row-parallel layer of K inputs: the most (TREE_LEAVES, 4, 2, 1)
    such that each leaf is a whole number of MIN_BLOCK_K steps. A function of K alone."""
    leaves = TREE_LEAVES
    while leaves > 1 and k % (leaves * MIN_BLOCK_K):
        leaves //= 2
    return leaves


def gpu_row_parallel_config(dtype: torch.dtype, n: int, k: int) -> LinearConfig:
    """The GPU config of a row-parallel layer: K cut into ``tree_leaves(k)`` leaves, each leaf into
    the same number of equal chunks (``_leaf_tree``), the widest tile that so fills TARGET_PROGRAMS.
    A chunk's last BLOCK_K step is masked at the chunk's end when the chunk is not a whole number
    of them (BLOCK_K is never shrunk). K not a multiple of 16: one leaf, the plain rule's tree."""
    if k % MIN_BLOCK_K:
        return gpu_linear_config(dtype, n, k)
    return _widest_filling([_leaf_tree(tile, n, k, tree_leaves(k)) for tile in _gpu_tiles(dtype)], n)


def chunk_length(config: LinearConfig, k: int) -> int:
    """The K width of each of ``config.k_chunks`` chunks (the last one may be shorter)."""
    if config.chunk_k:
        return config.chunk_k
    return triton.cdiv(triton.cdiv(k, config.block_k), config.k_chunks) * config.block_k
