"""The golden digests' formula: every weight and input of the golden models is a pure function of a name
and an index (splitmix64 in numpy integer arithmetic), scaled to values that bf16 and fp32 hold exactly;
and the digest of a list of tensors."""
from __future__ import annotations

import hashlib
import math
import zlib

import numpy as np
import torch


def _splitmix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def integers(name: str, count: int, low: int, high: int) -> np.ndarray:
    """``count`` integers in [low, high), a pure function of (name, index)."""
    counter = (np.uint64(zlib.crc32(name.encode())) << np.uint64(32)) | np.arange(count, dtype=np.uint64)
    return (_splitmix64(counter) % np.uint64(high - low)).astype(np.int64) + low


def parameter_values(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """fp32 values with at most 8 significant bits (exact in bf16): matrices j/128 / 2^round(log2(fan_in)/2),
    biases j/4096, norm weights in [0.5, 1.5)."""
    count = math.prod(shape)
    if len(shape) in (2, 3):  # matrices, and the experts' stacked [E, N, K] matrices
        scale = 2.0 ** -(7 + round(math.log2(shape[-1]) / 2))
        values = integers(name, count, -127, 128) * scale
    elif name.endswith("bias"):
        values = integers(name, count, -127, 128) * 2.0 ** -12
    else:
        values = integers(name, count, 64, 192) * 2.0 ** -7
    return torch.from_numpy(values.astype(np.float32).reshape(shape))


def digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(str(tuple(t.shape)).encode())
        h.update(t.detach().float().cpu().contiguous().numpy().tobytes())  # bf16 -> fp32 is exact
    return h.hexdigest()
