"""The kinds of a model or a checkpoint's config, as the support table (``support.py``) names them:
its structure (dense, MoE, hybrid, vision-language, windowed, encoder), its quantized format, its adapters,
and the config features some surfaces refuse."""
from __future__ import annotations

from torch import nn

from .cache_specs import SlidingWindowSpec, cache_specs, is_hybrid
from .families import ENCODER_FAMILIES, FAMILIES, is_vision_language, text_config
from .lora import is_peft_model, unwrap_peft


def quantization_kinds(quantization) -> set[str]:
    """The quantized formats of a ``quantization_config`` (a dict or a transformers config object)."""
    if quantization is None:
        return set()
    config = quantization if isinstance(quantization, dict) else quantization.to_dict()
    method = config.get("quant_method")
    if method is None:
        return set()
    if method == "mxfp4":
        return set() if config.get("dequantize") else {"quantized", "mxfp4"}
    if method == "fp8":
        return {"quantized", "transformers_fp8"}
    kinds = {"quantized"}
    if method != "compressed-tensors":
        return kinds
    for group in (config.get("config_groups") or {}).values():
        weights, activations = group.get("weights") or {}, group.get("input_activations")
        strategy = str(weights.get("strategy", "")).lower()
        if weights.get("type") == "float":
            kinds.add("fp8_block" if strategy == "block" else "fp8_dynamic")
        elif activations:
            kinds.add("w8a8_int8")
        else:
            kinds.add("w4a16_int4")
    return kinds


def _windowed(adapter, config) -> bool:
    return (any(isinstance(spec, SlidingWindowSpec) for spec in cache_specs(config))
            or adapter.model_type == "gpt_oss")  # gpt-oss: attention sinks too


def config_kinds(config) -> set[str]:
    """The kinds and refused features a checkpoint's config shows (no weights needed)."""
    model_type = getattr(config, "model_type", None)
    text = text_config(config)
    adapter = FAMILIES.get(model_type)
    kinds = quantization_kinds(getattr(config, "quantization_config", None))
    if adapter is not None:
        hybrid = is_hybrid(config)
        kinds.add("moe" if adapter.moe else "hybrid" if hybrid else "dense")
        if adapter.moe and hybrid:
            kinds.add("hybrid")
        if is_vision_language(config):
            kinds.add("vision_language")
        if adapter.latent_attention is not None:
            kinds.add("latent_attention")
            if "quantized" in kinds and "transformers_fp8" not in kinds:  # fp8: kv_b_proj read dequantized
                kinds.add("latent_attention_quantized")
        if _windowed(adapter, config):
            kinds.add("windowed")
        if adapter.moe and quantization_method_of(config) == "compressed-tensors":
            kinds.add("compressed_tensors_moe")
    if model_type in ENCODER_FAMILIES:
        kinds.add("encoder")
    if is_vision_language(config) and getattr(text, "use_sliding_window", False):
        kinds.add("vision_language_sliding_window")
    capped = ["attn_logit_softcapping"] + ([] if adapter is not None and adapter.final_logit_softcapping
                                           else ["final_logit_softcapping"])
    if any(getattr(text, name, None) is not None for name in capped):
        kinds.add("logit_softcapping")
    if model_type in ("gemma4_text", "gemma4"):  # gemma4: the multimodal checkpoint, its text model runs
        kinds.add("gemma4_text")
        if getattr(text, "enable_moe_block", False):  # experts beside the dense MLP: the MoE rows apply
            kinds.discard("dense")
            kinds.add("moe")
            if quantization_method_of(config) == "compressed-tensors":  # experts decompressed at load, as above
                kinds.add("compressed_tensors_moe")
    # "vision": only image tokens attend bidirectionally, and gemma4 runs no image (its text attends causally)
    if getattr(text, "use_bidirectional_attention", False) and not (
            model_type == "gemma4" and text.use_bidirectional_attention == "vision"):
        kinds.add("bidirectional_attention")
    return kinds


def quantization_method_of(config) -> str | None:
    quantization = getattr(config, "quantization_config", None)
    if quantization is None:
        return None
    return (quantization if isinstance(quantization, dict) else quantization.to_dict()).get("quant_method")


def model_kinds(model: nn.Module) -> set[str]:
    """The kinds of a loaded model: its config's, and ``lora`` / ``peft_model`` for a PeftModel."""
    kinds = config_kinds(unwrap_peft(model).config)
    if is_peft_model(model):
        kinds |= {"lora", "peft_model"}
    return kinds
