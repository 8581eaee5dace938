"""Tile configs for the linear and attention kernels: one per weight (or head) shape, never per M.

A config fixes the reduction order, so changing an entry changes the bits a model produces;
each entry is chosen once per (device type, dtype, shape) and never by batch size.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
from .errors import InvalidDtypeError
from .linear_configs import (MIN_BLOCK_K, TREE_LEAVES, LinearConfig, chunk_length, gpu_linear_config,  # noqa: F401
                             gpu_row_parallel_config, tree_leaves)

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


# The CPU (interpreter) tiles: large tiles mean fewer Python-level programs (trimmed to the weight
# in linear_config). One K chunk: the interpreter runs chunks in sequence anyway.
_CPU_CONFIG = LinearConfig(64, 512, 512)


def linear_config(device_type: str, dtype: torch.dtype, n: int, k: int) -> LinearConfig:
    """The one tile config used for this weight shape, whatever M is: on a GPU the rule of
    ``linear_configs.gpu_linear_config``, a function of (dtype, N, K) alone."""
    if dtype not in SUPPORTED_DTYPES:
        raise InvalidDtypeError(f"invariant linear supports {SUPPORTED_DTYPES}, got {dtype}")
    if tile_device(device_type) != "cpu":
        return gpu_linear_config(dtype, n, k)
    # small test models: do not pay for tiles far wider than the weight
    return replace(_CPU_CONFIG, block_n=min(_CPU_CONFIG.block_n, max(16, triton.next_power_of_2(n))),
                   block_k=min(_CPU_CONFIG.block_k, max(16, triton.next_power_of_2(k))))


# Row-parallel layers (o_proj, down_proj: tensor parallelism splits their K) reduce K as a tree of
# up to TREE_LEAVES equal leaves, each summed from its own start, the leaves' fp32 sums added in leaf
# order. A TP size t dividing the leaf count gives each rank whole leaves, so every TP size that
# divides it (and one process) computes the same tree: see linear_configs.tree_leaves.
def row_parallel_config(device_type: str, dtype: torch.dtype, n: int, k: int) -> LinearConfig:
    """The config of a row-parallel layer, fixed by the shape alone: K cut into ``tree_leaves(k)``
    leaves (on a GPU each leaf cut further into equal chunks: ``gpu_row_parallel_config``), each
    chunk walked in BLOCK_K steps from its own start on every rank, its last step masked at the
    chunk's end. In the interpreter, whose cost is per step, BLOCK_K is the leaf's next power of two
    (up to linear_config's) and a chunk is one leaf."""
    if tile_device(device_type) != "cpu":
        if dtype not in SUPPORTED_DTYPES:
            raise InvalidDtypeError(f"invariant linear supports {SUPPORTED_DTYPES}, got {dtype}")
        return gpu_row_parallel_config(dtype, n, k)
    base = linear_config(device_type, dtype, n, k)
    leaves = tree_leaves(k)
    leaf = k // leaves
    if leaves > 1:
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
    if head_dim > 256:  # DeepSeek-V3's absorbed latent (512 + 64, BLOCK_D 1024): 32 x 32 tiles need 194 KiB of
        # shared memory, over sm_80's and sm_89's limits; 16 x 16 need 97 KiB, which every arch gives (they spill).
        return AttentionConfig(block_m=16, block_n=16, num_warps=4, kv_chunk=512)
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
