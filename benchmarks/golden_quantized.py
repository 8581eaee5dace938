"""Golden digests of quantized checkpoints: one fixed model per format, its weights from the
golden formula (``benchmarks.golden_digests.parameter_values``), quantized by compressed-tensors'
own compressors (min/max qparams, no calibration data) or written in transformers' ``fp8`` format,
loaded with ``from_pretrained`` and digested like the dense models (alone and in three batchings).

Every K is a multiple of 128 (group and block formats), activations are bf16 (weight-only formats
need 16-bit activations), and the keys are ``quant/<format>/bf16/<case>``.
"""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from invariant_infer.checkpoints.quantized import quantized_loading
from invariant_infer.model.families import FAMILIES
from invariant_infer.model.patch import make_invariant

FAMILY = "qwen2"
FORMATS = ("FP8_DYNAMIC", "FP8_BLOCK", "W8A8", "W4A16", "W4A16_ASYM", "fp8")
WIDTHS = dict(hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=2)


def write_quantized_checkpoint(fmt: str, path: Path) -> Path:
    from benchmarks.golden_digests import CONFIGS, parameter_values
    from invariant_infer.testing.quantized_checkpoints import save_fp8_model, save_quantized_model

    config = FAMILIES[FAMILY].config_class(**{**CONFIGS[FAMILY], **WIDTHS})
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(parameter_values(name, tuple(param.shape)))
    model = model.to(torch.bfloat16).eval()
    return save_fp8_model(model, path) if fmt == "fp8" else save_quantized_model(model, path, fmt)


def quantized_digests(device: str, tmp: Path, formats=FORMATS, progress=None) -> dict[str, str]:
    from benchmarks.golden_digests import model_digests

    out = {}
    for fmt in formats:
        path = write_quantized_checkpoint(fmt, tmp / f"quant-{fmt}")
        with quantized_loading():
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device).eval()
        out.update(model_digests(make_invariant(model), FAMILY, f"quant/{fmt}/bf16"))
        if progress:
            progress(f"quant/{fmt}")
    return out
