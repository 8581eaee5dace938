"""The fuzz's quantized models: ``--formats`` turns each family into one model per checkpoint format,
named ``family:FORMAT`` (``family`` alone for the unquantized model, format ``none``); the
compressed-tensors formats apply to the dense families, transformers' ``fp8`` also to the
mixture-of-experts ones (experts included, Qwen2-MoE's one-output shared-expert gate kept dense).

Each quantized model is the family's fuzz model at widths the formats need (every K and N a multiple
of 128: hidden 128, 2 heads of 64 on 2 KV heads, intermediate 256), written per dtype with
compressed-tensors' own compressors (or in transformers' ``fp8`` format) and loaded with
``from_pretrained`` in ``quantized_loading()``, as users load them. The negative control's
batch-variant paths for these layers: a dynamic *per-tensor* activation scale (the max over the
whole batch; in the experts, over every routed row) and, for weight-only layers, a quantized GEMM
whose BLOCK_K is picked by M.
"""
from __future__ import annotations

import contextlib
import io
from dataclasses import replace
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig

import invariant_infer.model.quantization as quantization
import invariant_infer.model.quantized_experts as quantized_experts
from invariant_infer.model.families import FAMILIES
from invariant_infer.checkpoints.quantized import quantized_loading
from invariant_infer.kernels import quantized_linear
from invariant_infer.kernels.quantized_linear import quantized_linear_config

# compressed-tensors presets (W8A16 is pack-quantized int8), and transformers' own block fp8
QUANT_FORMATS = ("FP8_DYNAMIC", "FP8_BLOCK", "W8A8", "W4A16", "W4A16_ASYM", "W8A16", "fp8")
FORMATS = ("none",) + QUANT_FORMATS
QUANT_DTYPES = ("bf16", "fp16")  # weight-only layers run in bf16/fp16 activations
QUANT_OVERRIDES = dict(hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=2,
                       head_dim=64, moe_intermediate_size=128, shared_expert_intermediate_size=128)
SMALL_M = 32  # negative control: the weight-only GEMM's BLOCK_K is 16 at M <= SMALL_M rows


def split(model: str) -> tuple[str, str | None]:
    """``"qwen2:FP8_BLOCK"`` -> ``("qwen2", "FP8_BLOCK")``; ``"qwen2"`` -> ``("qwen2", None)``."""
    family, _, fmt = model.partition(":")
    return family, fmt or None


def family_preset(model: str) -> tuple[str, str]:
    """``"gemma4_text@tiny-moe"`` -> ``("gemma4_text", "tiny-moe")``; ``"qwen2:W8A8"`` -> ``("qwen2", "tiny")``."""
    family, _, preset = split(model)[0].partition("@")
    return family, preset or "tiny"


def model_names(families, formats) -> list[str]:
    """The fuzz's models: each family in each format, in that order (``none``: the family itself).
    MoE families in ``none`` and ``fp8`` only: make_invariant refuses compressed-tensors MoE models;
    hybrid families and other presets (``family@preset``: Gemma 4's MoE, whose quantized experts it
    refuses) in ``none`` only: it refuses quantized hybrid models."""
    def runs(model: str, fmt: str) -> bool:
        family, preset = family_preset(model)
        adapter = FAMILIES[family]
        return fmt == "none" or (preset == "tiny" and adapter.linear_attention is None
                                 and (fmt == "fp8" or adapter.moe is None))
    return [f if fmt == "none" else f"{f}:{fmt}" for f in families for fmt in formats if runs(f, fmt)]


def quant_overrides(family: str) -> dict:
    """The widths above that the family's config has (the MoE sizes only for MoE families); head_dim
    always (64 = 128 / 2 heads, which some families' tiny presets override)."""
    keys = FAMILIES[family].config_class().to_dict()
    return {k: v for k, v in QUANT_OVERRIDES.items() if k in keys or k == "head_dim"}


def write_and_load(path: Path, config: PretrainedConfig, fmt: str, seed: int, dtype: torch.dtype, device: str):
    """A random ``config`` model saved in ``fmt`` (in ``dtype``) under ``path``, loaded as users load it."""
    from invariant_infer.testing.quantized_checkpoints import save_fp8_checkpoint, save_quantized_checkpoint

    with contextlib.redirect_stderr(io.StringIO()):  # compressed-tensors' progress bars
        if not path.exists():
            if fmt == "fp8":
                moe = FAMILIES[config.model_type].moe
                dense = ["lm_head", "shared_expert_gate"] if moe is not None and moe.shared_expert else None
                save_fp8_checkpoint(path, config, seed=seed, dtype=dtype, modules_to_not_convert=dense)
            else:
                save_quantized_checkpoint(path, config, fmt, seed=seed, dtype=dtype)
        with quantized_loading():
            return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()


def per_tensor_activations(x2: torch.Tensor, dtype: torch.dtype, group_size: int | None = None):
    """The batch-variant activation quantization stock paths use with a per-tensor dynamic scale:
    one scale for every token and group, the max over the whole batch."""
    qmax = 448.0 if dtype == torch.float8_e4m3fn else 127.0
    scale = (x2.float().abs().amax() / qmax).clamp(min=1e-12)
    scaled = x2.float() / scale
    q = (scaled.clamp(-448, 448) if dtype == torch.float8_e4m3fn else scaled.round().clamp(-128, 127)).to(dtype)
    groups = 1 if group_size is None else x2.shape[1] // group_size
    return q, scale.reshape(1, 1).expand(x2.shape[0], groups).contiguous()


def m_dependent_quantized_linear(x, weight, bias=None, x_scale=None, out_dtype=None, config=None):
    """Negative control for weight-only layers: BLOCK_K 16 at most SMALL_M rows, the weight's own above."""
    config = config or quantized_linear_config(x.device.type, weight)
    if x_scale is None and x.reshape(-1, x.shape[-1]).shape[0] <= SMALL_M:
        config = replace(config, block_k=16)
    return quantized_linear(x, weight, bias, x_scale=x_scale, out_dtype=out_dtype, config=config)


@contextlib.contextmanager
def batch_variant_quantized_layers():
    """The quantized layers' two batch-variant paths (see the module docstring), put back on exit."""
    originals = quantization.quantize_activations, quantization.quantized_linear, quantized_experts.quantize_activations
    quantization.quantize_activations = quantized_experts.quantize_activations = per_tensor_activations
    quantization.quantized_linear = m_dependent_quantized_linear
    try:
        yield
    finally:
        (quantization.quantize_activations, quantization.quantized_linear,
         quantized_experts.quantize_activations) = originals
