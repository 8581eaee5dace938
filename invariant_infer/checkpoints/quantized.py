"""Loading quantized checkpoints that stock ``from_pretrained`` cannot load as stored.

``quantized_loading()`` enters both contexts below; ``checkpoints.loading.load_model`` loads in it.

Asymmetric ``pack-quantized`` checkpoints (``W4A16_ASYM``): compressed-tensors (0.20) writes each
layer's zero points packed along N into int32 ``[N * bits / 32, groups]``, but the compressed layout
it builds before loading keeps them unpacked ``[N, groups]``, so ``from_pretrained`` stops on a size
mismatch. ``packed_zero_points()`` gives that layout the stored shape and dtype while it is active
(one class attribute, put back on exit); the tensors then load as stored and stay packed.

transformers' own ``fp8`` checkpoints (``weight_block_size`` [128, 128], ``weight_scale_inv``):
without a GPU, transformers dequantizes them to bf16 at load and drops their quantization config,
so nothing is left to run as FP8. ``fp8_layers_on_cpu()`` keeps its ``FP8Linear`` layers (fp8
weights, inverse block scales) on CPU too, as a GPU load keeps them, unless ``dequantize=True``
was asked for.
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


@contextlib.contextmanager
def fp8_layers_on_cpu():
    """While active, transformers' fp8 quantizer keeps a pre-quantized checkpoint's FP8Linear
    layers when no GPU is present, instead of dequantizing them to bf16."""
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    with _LOCK:
        original = FineGrainedFP8HfQuantizer.validate_environment

        def validate_environment(self, *args, **kwargs):
            if (self.pre_quantized and not self.quantization_config.dequantize and not torch.cuda.is_available()
                    and not (hasattr(torch, "xpu") and torch.xpu.is_available())):
                return None  # no GPU: keep the FP8 layers (the invariant kernels run them on CPU)
            return original(self, *args, **kwargs)

        FineGrainedFP8HfQuantizer.validate_environment = validate_environment
        try:
            yield
        finally:
            FineGrainedFP8HfQuantizer.validate_environment = original


@contextlib.contextmanager
def quantized_loading():
    """Both: asymmetric packed zero points as stored, and fp8 layers kept without a GPU."""
    with packed_zero_points(), fp8_layers_on_cpu():
        yield
