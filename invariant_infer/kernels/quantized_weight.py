"""A quantized weight kept in its checkpoint format, and the one GEMM tile config it takes.

Weight formats (``QuantizedWeight.format``):
  * ``"fp8"``: float8_e4m3fn [N, K], fp32/bf16/fp16 scales per output channel [N, 1] or per
    128x128 block [ceil(N/128), ceil(K/128)];
  * ``"int8"``: int8 [N, K], scales per output channel [N, 1];
  * ``"packed"``: 4- or 8-bit integers packed along K into int32 [N, K * bits / 32] (element k of
    a row at bits (k % (32/bits)) * bits of word k // (32/bits), stored + 2**(bits-1)), scales
    per group of ``group_size`` along K [N, K / group_size]; asymmetric weights add zero points
    per group, packed the same way along N (compressed-tensors' layout) [N * bits / 32, K / group_size],
    and dequantize as ``(q - zero_point) * scale``.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton

from .configs import tile_device
from .errors import InvalidArgumentError
from .linear_configs import MIN_CHUNK_K, TARGET_PROGRAMS, chunk_steps

WEIGHT_FORMATS = ("fp8", "int8", "packed")
BLOCK = 128  # the block formats' 128x128 weight blocks and 128-wide activation groups


@dataclass(frozen=True)
class QuantizedWeight:
    """A weight kept compressed: ``data`` in ``format``, ``scale`` per channel, group or block."""
    format: str
    data: torch.Tensor
    scale: torch.Tensor
    shape: tuple[int, int]          # (N, K) of the dense weight
    bits: int = 8                   # packed only: 4 or 8
    group_size: int | None = None   # packed: the scale group along K; None for per channel
    block: bool = False             # fp8 only: 128x128 block scales
    zero_point: torch.Tensor | None = None  # packed only: int32, packed along N like the values

    def __post_init__(self):
        if self.format not in WEIGHT_FORMATS:
            raise InvalidArgumentError(f"weight format must be one of {WEIGHT_FORMATS}, got {self.format!r}")
        if self.zero_point is not None and self.format != "packed":
            raise InvalidArgumentError(f"zero points are for packed weights, not {self.format}")

    @property
    def experts(self) -> int | None:
        """How many experts' weights the tensors stack ([E, ...]); None for one weight."""
        return self.data.shape[0] if self.data.dim() == 3 else None

    def expert(self, index: int) -> QuantizedWeight:
        """Expert ``index``'s weight of a stacked one: views of its tensors."""
        zero_point = None if self.zero_point is None else self.zero_point[index]
        return replace(self, data=self.data[index], scale=self.scale[index], zero_point=zero_point)

    @property
    def scale_group_k(self) -> int:
        """How many consecutive k share one scale column."""
        if self.block:
            return BLOCK
        return self.group_size or self.shape[1]


@dataclass(frozen=True)
class QuantizedLinearConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    k_chunks: int = 1   # the K tree: this many chunks of chunk_k (whole scale groups), summed in order
    chunk_k: int = 0    # a multiple of block_k; 0 with one chunk


def quantized_linear_config(device_type: str, weight: QuantizedWeight) -> QuantizedLinearConfig:
    """One tile config per (device type, weight shape and format), never per M. BLOCK_K divides
    the scale group so a K tile never straddles two scales. On a GPU, linear's rule: the widest
    BLOCK_N whose tiles times K chunks (of whole scale groups, at least MIN_CHUNK_K long) fill
    TARGET_PROGRAMS at one row tile."""
    n, k = weight.shape
    group = weight.scale_group_k
    block_k = min(BLOCK, group) if group < k else BLOCK
    if group < k and (group & (group - 1) or group < 16):
        raise InvalidArgumentError(f"scale groups along K must be a power of two >= 16, got {group}")
    if tile_device(device_type) == "cpu":  # interpreter: large tiles mean fewer Python-level programs
        return QuantizedLinearConfig(64, min(256, max(16, triton.next_power_of_2(n))), block_k)
    unit = group if group < k else block_k  # a chunk holds whole scale groups
    units = triton.cdiv(k, unit)
    trees = []
    for block_n in (128, 64, 32, 16):
        length = chunk_steps(triton.cdiv(n, block_n), units, max(1, MIN_CHUNK_K // unit))
        chunks = triton.cdiv(units, length)
        warps = 8 if block_n >= 64 else 4  # the dequantized tiles and two accumulators spill from 4 warps
        trees.append(QuantizedLinearConfig(64, block_n, block_k, num_warps=warps, k_chunks=chunks,
                                           chunk_k=length * unit if chunks > 1 else 0))
    programs = [triton.cdiv(n, cfg.block_n) * cfg.k_chunks for cfg in trees]
    return next((cfg for cfg, p in zip(trees, programs) if p >= TARGET_PROGRAMS), trees[programs.index(max(programs))])
