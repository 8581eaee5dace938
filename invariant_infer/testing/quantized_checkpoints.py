"""Small quantized checkpoints written with compressed-tensors' own compressors, for tests.

The recipe is llm-compressor's without llm-compressor: a preset scheme applied to every Linear
but lm_head, min/max qparams per module, then ``ModelCompressor`` compresses the weights, and
``save_pretrained`` plus ``update_config`` write them as a real quantized checkpoint would be.
"""
from __future__ import annotations

import re
from pathlib import Path

import torch
from transformers import PretrainedConfig

from .random_checkpoints import random_model
from ..errors import InvalidArgumentError

# Schemes with no preset of their own: (preset, the fields of its weight args that change).
DERIVED_SCHEMES = {"W8A16_ASYM": ("W4A16_ASYM", {"num_bits": 8})}


def _min_max(weight: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    """Observed weight range at the granularity of ``args.strategy`` (a plain min/max observer)."""
    strategy = str(args.strategy.value if hasattr(args.strategy, "value") else args.strategy)
    w = weight.float()
    if strategy == "tensor":
        return w.amin().reshape(1), w.amax().reshape(1)
    if strategy == "channel":
        return w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
    if strategy == "group":
        grouped = w.unflatten(1, (-1, args.group_size))
        return grouped.amin(dim=-1), grouped.amax(dim=-1)
    if strategy == "block":
        bn, bk = args.block_structure
        blocks = w.unflatten(0, (-1, bn)).unflatten(2, (-1, bk))
        return blocks.amin(dim=(1, 3)), blocks.amax(dim=(1, 3))
    raise InvalidArgumentError(f"no observer for weight strategy {strategy!r}")


def quantize_model(model: torch.nn.Module, scheme_name: str, ignore: tuple[str, ...] = ("lm_head",),
                   **activation_overrides):
    """Quantize every Linear but those ``ignore`` names (compressed-tensors' names or "re:" patterns)
    with compressed-tensors' preset ``scheme_name`` (in place, weights still dense);
    ``activation_overrides`` replace fields of the input activation args (e.g. ``strategy="tensor"``
    for a per-tensor dynamic scale)."""
    from compressed_tensors.quantization import (QuantizationConfig, QuantizationStatus, apply_quantization_config,
                                                 preset_name_to_scheme)
    from compressed_tensors.quantization.utils import calculate_qparams

    preset, weight_overrides = DERIVED_SCHEMES.get(scheme_name, (scheme_name, {}))
    scheme = preset_name_to_scheme(preset, ["Linear"])
    if weight_overrides:
        scheme.weights = scheme.weights.model_copy(update=weight_overrides)
    if activation_overrides:
        scheme.input_activations = scheme.input_activations.model_copy(update=activation_overrides)
    config = QuantizationConfig(config_groups={"group_0": scheme}, ignore=list(ignore))
    apply_quantization_config(model, config)
    with torch.no_grad():
        for module in model.modules():
            qscheme = getattr(module, "quantization_scheme", None)
            if qscheme is None or qscheme.weights is None:
                continue
            scale, zero_point = calculate_qparams(*_min_max(module.weight, qscheme.weights), qscheme.weights)
            module.weight_scale.data = scale.to(module.weight_scale.dtype).reshape(module.weight_scale.shape)
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.data = zero_point.to(module.weight_zero_point.dtype).reshape(
                    module.weight_zero_point.shape)
            if hasattr(module, "input_scale"):  # a static activation scale: a fixed range of +-8
                module.input_scale.data.fill_(8.0 / 448.0)
            module.quantization_status = QuantizationStatus.FROZEN
    return model


def save_quantized_checkpoint(path: str | Path, config: PretrainedConfig, scheme_name: str, seed: int = 0,
                              dtype: torch.dtype = torch.bfloat16, ignore: tuple[str, ...] = ("lm_head",),
                              **activation_overrides) -> Path:
    """A random model of ``config`` in ``dtype``, quantized with ``scheme_name`` (but the ``ignore``
    layers) and saved compressed."""
    return save_quantized_model(random_model(config, seed, dtype), path, scheme_name, ignore, **activation_overrides)


def save_quantized_model(model: torch.nn.Module, path: str | Path, scheme_name: str,
                         ignore: tuple[str, ...] = ("lm_head",), **activation_overrides) -> Path:
    """``model`` (dense, in its dtype) quantized with ``scheme_name`` (but the ``ignore`` layers) and
    saved compressed."""
    from compressed_tensors.compressors import ModelCompressor

    path = Path(path)
    model = quantize_model(model, scheme_name, ignore, **activation_overrides)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(path)
    compressor.update_config(path)
    return path


def save_fp8_checkpoint(path: str | Path, config: PretrainedConfig, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                        scale_dtype: torch.dtype = torch.bfloat16, modules_to_not_convert: list[str] | None = None,
                        per_tensor: bool = False) -> Path:
    """A random model of ``config`` in transformers' own ``fp8`` format, as the official Qwen3 FP8
    checkpoints store it: every Linear but lm_head, and every expert, as float8_e4m3fn ``weight`` with one inverse
    scale per 128x128 block in ``weight_scale_inv`` (``scale_dtype``), activations dynamic. Block
    scales are max |w| / 448 per block, as transformers' own ``Fp8Quantize`` computes them;
    ``per_tensor``: one scale per weight instead (``weight_block_size`` None)."""
    return save_fp8_model(random_model(config, seed, dtype), path, scale_dtype, modules_to_not_convert, per_tensor)


def _fp8_blocks(name: str, tensor: torch.Tensor, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 values [N, K] and inverse scales [ceil(N / 128), K / 128]. A last block of fewer than 128 rows
    (DeepSeek-V3's kv_a_proj_with_mqa: 576 = 4 x 128 + 64) takes its scale from its real rows, as
    transformers' ``FP8Linear`` and DeepSeek's checkpoints lay it out. K stays a multiple of 128: the fp8
    GEMM quantizes activations in 128-wide groups along K."""
    n, k = tensor.shape
    if k % 128:
        raise InvalidArgumentError(f"{name}: fp8 block checkpoints need in_features that are multiples of 128, got "
                                   f"{n}x{k}")
    padded = torch.nn.functional.pad(tensor.float(), (0, 0, 0, -n % 128))  # zero rows: no block's max changes
    blocks = padded.unflatten(0, (-1, 128)).unflatten(2, (-1, 128))
    amax = blocks.abs().amax(dim=(1, 3))
    inverse = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax)).to(scale_dtype)
    full = inverse.float()[:, None, :, None]
    values = (blocks / full).clamp(-448, 448).to(torch.float8_e4m3fn).flatten(2).flatten(0, 1)
    return values[:n].contiguous(), inverse


def _fp8_tensor(name: str, tensor: torch.Tensor, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 values and one inverse scale, max |w| / 448 (a 0-dim tensor, as ``FP8Linear`` holds it)."""
    amax = tensor.float().abs().amax()
    inverse = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax)).to(scale_dtype)
    return (tensor.float() / inverse.float()).clamp(-448, 448).to(torch.float8_e4m3fn), inverse


# A mixture-of-experts checkpoint's expert weights: "...experts.<e>.<gate_proj|w1|...>.weight".
_EXPERT_KEY = re.compile(r"\.experts\.\d+\.[^.]+\.weight$")


def save_fp8_model(model: torch.nn.Module, path: str | Path, scale_dtype: torch.dtype = torch.bfloat16,
                   modules_to_not_convert: list[str] | None = None, per_tensor: bool = False) -> Path:
    """``model`` (dense) saved in transformers' ``fp8`` format, as ``save_fp8_checkpoint`` describes:
    ``save_pretrained`` writes the checkpoint's own layout (an MoE model's experts one by one), then
    every weight transformers' fp8 loader converts (plain Linear layers but lm_head, and experts) is
    stored as fp8 blocks. ``modules_to_not_convert`` names layers kept dense, as transformers reads it."""
    from safetensors.torch import load_file, save_file
    from transformers.quantizers.quantizers_utils import should_convert_module

    path = Path(path)
    model.save_pretrained(path)
    if not (path / "model.safetensors").exists():
        raise InvalidArgumentError(f"{path}: save_fp8_model writes one safetensors file; this model was sharded")
    linears = {f"{name}.weight" for name, module in model.named_modules()
               if type(module) is torch.nn.Linear and name != "lm_head"
               and should_convert_module(name, modules_to_not_convert)}
    state = load_file(path / "model.safetensors")
    for name in list(state):
        if name in linears or _EXPERT_KEY.search(name):
            module = name.rsplit(".", 1)[0]
            quantize = _fp8_tensor if per_tensor else _fp8_blocks
            state[name], state[f"{module}.weight_scale_inv"] = quantize(module, state[name], scale_dtype)
    model.config.quantization_config = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                        "weight_block_size": None if per_tensor else [128, 128],
                                        **({"modules_to_not_convert": modules_to_not_convert}
                                           if modules_to_not_convert else {})}
    model.config.save_pretrained(path)
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    return path
