"""Random-init checkpoints of every supported family (decoders and encoders), for tests, the demo and benchmarks.

Real models' shapes (``"qwen2.5-1.5b"``, ``"llama-3.1-8b"`` ...) and small ones that run on CPU
(``"tiny"``) come from each family's presets (``invariant_infer.model.families``). Weights are random,
and so are the biases, RMSNorm weights and attention sinks that transformers initialises to
constants or near 0, so that every patched path carries signal. The MoE families' 3-D expert weights and routers are drawn by
transformers' own init (normal, std ``initializer_range``), a different draw per expert.
"""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModel, AutoModelForCausalLM, AutoModelForImageTextToText, PretrainedConfig

from ..model.families import ENCODER_FAMILIES, FAMILIES, is_vision_language
from ..errors import InvalidArgumentError


def random_config(family: str = "qwen2", preset: str = "tiny", **overrides) -> PretrainedConfig:
    """A config of ``family`` (a model_type, decoder or encoder) from a preset name, with any field overridden."""
    adapter = FAMILIES.get(family) or ENCODER_FAMILIES.get(family)
    if adapter is None:
        raise InvalidArgumentError(f"unknown family {family!r}; choose from "
                                   f"{sorted(FAMILIES) + sorted(ENCODER_FAMILIES)}")
    if preset not in adapter.presets:
        raise InvalidArgumentError(f"unknown {family} preset {preset!r}; choose from {sorted(adapter.presets)}")
    return adapter.config_class(**{**adapter.presets[preset], **overrides})


def qwen2_config(preset: str = "tiny", **overrides) -> PretrainedConfig:
    return random_config("qwen2", preset, **overrides)


def random_model(config: PretrainedConfig, seed: int = 0, dtype: torch.dtype = torch.float32, auto_class=None):
    """A randomly initialised causal LM (or vision-language model; an encoder family's ``AutoModel``) for
    ``config``, in eval mode; ``auto_class`` picks another (``AutoModelForSequenceClassification``)."""
    torch.manual_seed(seed)
    if auto_class is None:
        auto_class = AutoModelForImageTextToText if is_vision_language(config) else \
            AutoModel if config.model_type in ENCODER_FAMILIES else AutoModelForCausalLM
    model = auto_class.from_config(config).to(dtype).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith((".bias", "_proj_bias")):  # gpt-oss's experts: gate_up_proj_bias, down_proj_bias
                param.normal_(0.0, 0.02)
            elif name.endswith(".sinks"):  # gpt-oss's attention sinks: a share of each row's softmax
                param.normal_(0.0, 1.0)
            elif "norm" in name.rsplit(".", 2)[-2]:  # RMSNorm weights start at ones
                param.add_(torch.randn_like(param) * 0.1)
            elif name.endswith((".router.scale", ".router.per_expert_scale")):  # Gemma 4's router: ones
                param.uniform_(0.5, 1.5)
            elif name.endswith("LayerNorm.weight"):  # an encoder's LayerNorms (their biases are drawn above)
                param.add_(torch.randn_like(param) * 0.1)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # a sigmoid router's selection bias starts at zero
                buffer.normal_(0.0, 0.05)
            elif name.endswith(".layer_scalar"):  # Gemma 4's per-layer output scale starts at one
                buffer.uniform_(0.5, 1.5)
    return model


def save_random_checkpoint(path: str | Path, config: PretrainedConfig, seed: int = 0,
                           dtype: torch.dtype = torch.float32, auto_class=None) -> Path:
    """Write a random checkpoint with ``save_pretrained`` so tests load it as users load real ones."""
    path = Path(path)
    random_model(config, seed, dtype, auto_class).save_pretrained(path)
    return path
