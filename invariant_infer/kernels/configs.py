"""Tile configs for the linear and attention kernels: one per weight (or head) shape, never per M.

A config fixes the reduction order, so changing an entry changes the bits a model produces;
each entry is chosen once per (device type, dtype, shape) and never by batch size.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
from .errors import InvalidDtypeError

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class TileTarget:
    """The GPU whose tiles CPU tensors take while ``launch_recording`` records launches (not run)."""
    device_type: str = "cuda"
    sm_count: int = 132  # an H100 SXM's: picks linear's chunk schedule as that GPU would


_tile_target: list[TileTarget | None] = [None]


def tile_device(device_type: str) -> str:
    """The device type whose tiles (and launch parameters) a launch on ``device_type`` tensors
    takes: its own, but while ``launch_recording`` records CPU launches for a GPU target."""
    target = _tile_target[0]
    return target.device_type if target is not None and device_type == "cpu" else device_type


def tile_target() -> TileTarget | None:
    return _tile_target[0]


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


# (device type, dtype) -> default config. Valid on sm_80/sm_89 shared memory too:
# (64*64 + 64*128) * 2 B * 3 stages = 72 KiB for 16-bit types.
_DEFAULT_CONFIGS = {
    ("cuda", torch.bfloat16): LinearConfig(64, 128, 64),
    ("cuda", torch.float16): LinearConfig(64, 128, 64),
    ("cuda", torch.float32): LinearConfig(64, 64, 32),
    # Interpreter: large tiles mean fewer Python-level programs (trimmed to the weight below).
    ("cpu", torch.bfloat16): LinearConfig(64, 512, 512),
    ("cpu", torch.float16): LinearConfig(64, 512, 512),
    ("cpu", torch.float32): LinearConfig(64, 512, 512),
}

# Per-weight-shape CUDA configs, keyed by (N, K), for bf16 and fp16.
# PREDICTIONS, NOT MEASURED ON A GPU: recorded in benchmarks/results/LOG.md, to be measured with
# benchmarks/gpu_check.sh. Rationale: at small M (one 64-row tile) the output tiles alone fill
# few of an H100/H200's 132 SMs, so shapes with few N tiles get a fixed K-chunk tree that the
# parallel schedule spreads over more programs. Every tile stays within 72 KiB of shared memory
# at 3 stages for 16-bit types (sm_80/89 safe). The kernel cuts K into chunks of
# ceil(K / BLOCK_K / k_chunks) BLOCK_Ks, so a k_chunks dividing K / BLOCK_K gives equal chunks.
_QWEN25_1_5B = {
    (1536, 1536): LinearConfig(64, 64, 64, k_chunks=4),    # q, o: 24 N tiles -> 96 programs at M <= 64
    (256, 1536): LinearConfig(64, 32, 64, k_chunks=4),     # k, v: 8 N tiles -> 32 programs
    (8960, 1536): LinearConfig(64, 128, 64, k_chunks=2),   # gate, up: 70 N tiles -> 140 programs
    (1536, 8960): LinearConfig(64, 64, 64, k_chunks=8),    # down: 24 N tiles -> 192 programs, 18 a chunk (last: 14)
    (151936, 1536): LinearConfig(64, 128, 64),             # lm_head: 1187 N tiles already
}
# Hidden 4096, 32 query / 8 KV heads of 128: q/o and k/v are the same shapes in both models,
# so one entry serves Qwen3-8B and Llama-3.1-8B. K = 4096 is 64 BLOCK_Ks.
_QWEN3_8B_AND_LLAMA31_8B = {
    (4096, 4096): LinearConfig(64, 128, 64, k_chunks=4),   # q, o: 32 N tiles -> 128 programs, 16 BLOCK_Ks a chunk
    (1024, 4096): LinearConfig(64, 64, 64, k_chunks=8),    # k, v: 16 N tiles -> 128 programs, 8 a chunk
}
_QWEN3_8B = {  # intermediate 12288, vocab 151936
    (12288, 4096): LinearConfig(64, 128, 64, k_chunks=2),  # gate, up: 96 N tiles -> 192 programs, 32 a chunk
    (4096, 12288): LinearConfig(64, 128, 64, k_chunks=4),  # down: 32 N tiles -> 128 programs, 48 a chunk
    (151936, 4096): LinearConfig(64, 128, 64),             # lm_head: 1187 N tiles already
}
_LLAMA31_8B = {  # intermediate 14336, vocab 128256
    (14336, 4096): LinearConfig(64, 128, 64, k_chunks=2),  # gate, up: 112 N tiles -> 224 programs, 32 a chunk
    (4096, 14336): LinearConfig(64, 128, 64, k_chunks=4),  # down: 32 N tiles -> 128 programs, 56 a chunk
    (128256, 4096): LinearConfig(64, 128, 64),             # lm_head: 1002 N tiles already
}
_CUDA_SHAPE_CONFIGS = {**_QWEN25_1_5B, **_QWEN3_8B_AND_LLAMA31_8B, **_QWEN3_8B, **_LLAMA31_8B}
LINEAR_CONFIGS: dict[tuple, LinearConfig] = {
    ("cuda", dtype, n, k): cfg
    for dtype in (torch.bfloat16, torch.float16) for (n, k), cfg in _CUDA_SHAPE_CONFIGS.items()
}


def linear_config(device_type: str, dtype: torch.dtype, n: int, k: int) -> LinearConfig:
    """The one tile config used for this weight shape, whatever M is."""
    if dtype not in SUPPORTED_DTYPES:
        raise InvalidDtypeError(f"invariant linear supports {SUPPORTED_DTYPES}, got {dtype}")
    device_type = tile_device(device_type)
    cfg = LINEAR_CONFIGS.get((device_type, dtype, n, k))
    if cfg is not None:
        return cfg
    cfg = _DEFAULT_CONFIGS[(device_type, dtype)]
    if device_type == "cpu":  # small test models: do not pay for tiles far wider than the weight
        cfg = replace(cfg, block_n=min(cfg.block_n, max(16, triton.next_power_of_2(n))),
                      block_k=min(cfg.block_k, max(16, triton.next_power_of_2(k))))
    return cfg


# Row-parallel layers (o_proj, down_proj: tensor parallelism splits their K) reduce K as a tree of
# up to TREE_LEAVES equal leaves, each summed in BLOCK_K steps from its own start, the leaves' fp32
# sums added in leaf order. A TP size t dividing the leaf count gives each rank whole leaves, so
# every TP size that divides it (and one process) computes the same tree: see tree_leaves.
TREE_LEAVES = 8
MIN_BLOCK_K = 16  # tl.dot's smallest K


def tree_leaves(k: int) -> int:
    """Leaves of the K tree for a row-parallel layer of K inputs: the most (TREE_LEAVES, 4, 2, 1)
    such that each leaf is a whole number of MIN_BLOCK_K steps. A function of K alone."""
    leaves = TREE_LEAVES
    while leaves > 1 and k % (leaves * MIN_BLOCK_K):
        leaves //= 2
    return leaves


def chunk_length(config: LinearConfig, k: int) -> int:
    """The K width of each of ``config.k_chunks`` chunks (the last one may be shorter)."""
    if config.chunk_k:
        return config.chunk_k
    return triton.cdiv(triton.cdiv(k, config.block_k), config.k_chunks) * config.block_k


def row_parallel_config(device_type: str, dtype: torch.dtype, n: int, k: int) -> LinearConfig:
    """The config of a row-parallel layer: ``linear_config``'s tiles, K cut into ``tree_leaves(k)``
    chunks (leaves), each walked in BLOCK_K steps from its own start on every rank. Fixed by the
    shape alone. On CUDA, BLOCK_K is the largest power of two up to linear_config's that divides a
    leaf. In the interpreter, whose cost is per step, BLOCK_K is the leaf's next power of two (up to
    linear_config's) and a leaf's last step is masked at the leaf's end (``chunk_k``)."""
    device_type = tile_device(device_type)
    base = linear_config(device_type, dtype, n, k)
    leaves = tree_leaves(k)
    leaf = k // leaves
    if device_type == "cpu" and leaves > 1:
        return replace(base, block_k=min(base.block_k, triton.next_power_of_2(leaf)), k_chunks=leaves, chunk_k=leaf)
    block_k = base.block_k
    while block_k > MIN_BLOCK_K and leaf % block_k:
        block_k //= 2
    if leaf % block_k:  # k is not a multiple of 16: one leaf, BLOCK_K steps masked at its end
        return replace(base, k_chunks=1)
    return replace(base, block_k=block_k, k_chunks=leaves)


@dataclass(frozen=True)
class AttentionConfig:
    block_m: int
    block_n: int  # the KV block: fixed per (device, dtype, head_dim), never per batch
    num_warps: int = 4
    num_stages: int = 2
    # The KV chunk: a row's keys are reduced in chunks of this many (a multiple of block_n, counted
    # from the row's first key), whose softmax states merge in order. Part of the reduction tree, so
    # fixed like the blocks; the default is a multiple of every block_n used.
    kv_chunk: int = 512


def attention_config(device_type: str, dtype: torch.dtype, head_dim: int) -> AttentionConfig:
    if dtype not in SUPPORTED_DTYPES:
        raise InvalidDtypeError(f"invariant attention supports bf16/fp16/fp32, got {dtype}")
    device_type = tile_device(device_type)
    if device_type == "cpu":  # two blocks a chunk: tests cross several chunks at a few hundred keys
        return AttentionConfig(block_m=32, block_n=64, kv_chunk=128)
    # 512 keys a chunk: decode of Qwen2.5-1.5B (12 query heads) at 8K context runs 12 x 16 = 192
    # chunk programs, more than an H100's 132 SMs, while a prefill tile pays one merge per 8 or 16
    # blocks; a smaller chunk would fill more SMs at short contexts but cost prefill more merges.
    # A tile holds a chunk's (m, l, acc) and the running total's: from head_dim 128 on, 8 warps
    # compile without spills on sm_90 (206 registers at 128, 175 at 256; 4 warps need 255 and spill).
    if dtype == torch.float32 or head_dim > 128:
        return AttentionConfig(block_m=32, block_n=32, num_warps=8 if head_dim > 128 else 4, kv_chunk=512)
    return AttentionConfig(block_m=64, block_n=64, num_warps=8 if head_dim > 64 else 4, kv_chunk=512)


@dataclass(frozen=True)
class AttentionBackwardConfig:
    """The dK/dV kernel's tiles (the dQ kernel uses the forward's AttentionConfig). ``block_m``
    query positions per tile fixes the order each key's gradient is summed in; ``block_n`` keys
    per program is the forward's KV block."""
    block_m: int
    block_n: int
    delta_rows: int = 16  # rows per program of the delta = rowsum(dO * O) preprocess
    num_warps: int = 4
    num_stages: int = 2
    # False starts the query tiles at row 0, as a plain FlashAttention-2 backward does: then the
    # amount of left padding regroups a key's sum. Batch-variant; the tests' negative control.
    tiles_from_kv_start: bool = True


def attention_backward_config(device_type: str, dtype: torch.dtype, head_dim: int) -> AttentionBackwardConfig:
    """One per (device, dtype, head_dim), never per batch. CUDA tiles keep the dK/dV kernel's
    shared memory within sm_80/sm_89's 99 KiB at head_dim 128 (checked by the offline compile test)."""
    device_type = tile_device(device_type)
    forward = attention_config(device_type, dtype, head_dim)
    if device_type == "cpu":
        return AttentionBackwardConfig(block_m=32, block_n=forward.block_n, delta_rows=64)
    if dtype == torch.float32 or head_dim > 128:
        return AttentionBackwardConfig(block_m=16, block_n=forward.block_n)
    return AttentionBackwardConfig(block_m=32, block_n=forward.block_n)
