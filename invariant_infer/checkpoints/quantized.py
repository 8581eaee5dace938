"""Loading quantized checkpoints that stock ``from_pretrained`` cannot load as stored.

Asymmetric ``pack-quantized`` checkpoints (``W4A16_ASYM``): compressed-tensors (0.20) writes each
layer's zero points packed along N into int32 ``[N * bits / 32, groups]``, but the compressed layout
it builds before loading keeps them unpacked ``[N, groups]``, so ``from_pretrained`` stops on a size
mismatch. ``packed_zero_points()`` gives that layout the stored shape and dtype while it is active
(one class attribute, put back on exit); the tensors then load as stored and stay packed.
"""
from __future__ import annotations

import contextlib
import threading

import torch

_LOCK = threading.RLock()


def _packed_shape(zero_point: torch.Tensor, bits: int) -> tuple[int, int]:
    return -(-zero_point.shape[0] * bits // 32), zero_point.shape[-1]


@contextlib.contextmanager
def packed_zero_points():
    """While active, compressed-tensors' load-time layout holds asymmetric packed zero points as
    they are stored. Does nothing without compressed-tensors."""
    try:
        from compressed_tensors.compressors.pack_quantized.base import PACK_ZP_STRATS, PackedQuantizationCompressor
    except ImportError:
        yield
        return
    with _LOCK:
        original = PackedQuantizationCompressor.__dict__["compress"]

        def compress(cls, state_dict, scheme):
            compressed = original.__func__(cls, state_dict, scheme)
            zero_point, args = compressed.get("weight_zero_point"), scheme.weights
            if (zero_point is not None and zero_point.device.type == "meta" and not args.symmetric
                    and args.strategy in PACK_ZP_STRATS and zero_point.dtype != torch.int32):
                compressed["weight_zero_point"] = torch.empty(_packed_shape(zero_point, args.num_bits),
                                                              dtype=torch.int32, device="meta")
            return compressed

        PackedQuantizationCompressor.compress = classmethod(compress)
        try:
            yield
        finally:
            PackedQuantizationCompressor.compress = original
