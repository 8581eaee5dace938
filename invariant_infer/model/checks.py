"""The checks ``make_invariant`` runs before it patches anything: the family, its config, every
projection, norm and MLP, parameter dtypes and devices. Anything the invariant forwards would not
compute exactly is refused with ``UnsupportedModelError``, naming the module; what a kind of model does
not run is refused by the support table (``support.require``)."""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from . import experts as experts_interface
from ..errors import UnsupportedModelError
from .cache_specs import linear_attention_layers
from .families import family_of, text_config
from .kinds import model_kinds
from .latent_attention import absorbed_kv_b_projections
from .lora import base_linear, lora_layers
from .quantization import quantized_layers
from .quantized_experts import quantized_experts
from .support import require

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SUPPORTED_DEVICES = ("cpu", "cuda")
# RoPE types whose frequencies do not depend on the sequence length (dynamic/longrope do).
STATIC_ROPE_TYPES = ("default", "linear", "yarn", "llama3", "proportional")


def base_model(model: nn.Module) -> nn.Module:
    """The decoder: ``model.model``, or a vision-language model's ``model.model.language_model``."""
    base = getattr(model, "model", model)
    base = getattr(base, "language_model", base)
    if not (hasattr(base, "layers") and hasattr(base, "rotary_emb") and hasattr(base, "norm")):
        raise UnsupportedModelError(f"{type(model).__name__} does not have the decoder layout (model.layers, "
                                    "model.norm, model.rotary_emb)")
    return base


def _not_plain_linear(name: str, module) -> UnsupportedModelError:
    kind = "missing" if module is None else f"{type(module).__module__}.{type(module).__name__}"
    return UnsupportedModelError(f"{name} is {kind}; only plain torch.nn.Linear layers, compressed-tensors layers "
                                 "and PEFT LoRA layers are supported")


def check_model(model: nn.Module, sharded: bool = False, strict: bool = False):
    """(adapter, base model, {quantized layer: plan}, {quantized experts: plan}, [PEFT LoRA layers])."""
    config = getattr(model, "config", None)
    adapter = family_of(config)
    base = base_model(model)
    kinds = model_kinds(model)
    require(kinds, "model", config.model_type)
    if sharded:
        require(kinds, "tensor_parallel", config.model_type)
    problem = adapter.refuse_config(config)
    if problem:
        raise UnsupportedModelError(f"{config.model_type}: {problem}")
    _check_activation(adapter, text_config(config))
    if adapter.vision is not None:
        _check_vision(adapter, model)
    rope = getattr(text_config(config), "rope_parameters", None) or {}
    nested = [params for params in rope.values() if isinstance(params, dict)]  # per layer type (Gemma 3)
    for rope_type in [params.get("rope_type", "default") for params in nested or [rope]]:
        if rope_type not in STATIC_ROPE_TYPES:
            raise UnsupportedModelError(f"rope_type {rope_type!r} rescales with sequence length, which depends on "
                                        f"the batch; supported: {STATIC_ROPE_TYPES}")
    if adapter.check_layer is not None:  # first: the quantized experts' plans below judge by other families' rules
        for index, layer in enumerate(base.layers):
            adapter.check_layer(layer, f"layers.{index}")
    quantized = quantized_layers(model, strict)
    experts = quantized_experts(model)
    compressed = {f"{name}.{p}" for name, module in model.named_modules() if module in quantized or module in experts
                  for p, _ in module.named_parameters(recurse=False)}
    linear = set(linear_attention_layers(config))
    for index, layer in enumerate(base.layers):
        _check_layer_kind(adapter, layer, index, index in linear)
        for name, proj in adapter.projections(layer).items():
            if type(base_linear(proj)) is not nn.Linear and base_linear(proj) not in quantized:
                raise _not_plain_linear(f"layers.{index}.{name}", proj)
        if adapter.is_sparse(layer):
            experts_interface.check_sparse_block(adapter, layer.mlp, f"layers.{index}.mlp", experts, quantized)
        elif adapter.mlp is None or type(layer.mlp) is not adapter.mlp:
            expected = [cls.__name__ for cls in (adapter.mlp, adapter.moe and adapter.moe.block) if cls]
            raise UnsupportedModelError(f"layers.{index}.mlp is {type(layer.mlp).__name__}, not the "
                                        f"{' or '.join(expected)} the {adapter.model_type} adapter patches")
        if index in linear:
            _check_linear_attention(adapter, layer.linear_attn, f"layers.{index}.linear_attn")
            continue
        if adapter.gated_attention is not None and type(layer.self_attn) is not adapter.gated_attention:
            raise UnsupportedModelError(f"layers.{index}.self_attn is {type(layer.self_attn).__name__}, not the "
                                        f"{adapter.gated_attention.__name__} the {adapter.model_type} adapter patches")
        for name in adapter.head_norms if getattr(text_config(config), "use_qk_norm", True) is not False else ():
            if type(getattr(layer.self_attn, name, None)) is not adapter.rms_norm:
                raise UnsupportedModelError(f"layers.{index}.self_attn.{name} is not a {adapter.rms_norm.__name__}")
    for name, module in model.named_modules():  # lm_head, score heads, anything Linear-like
        if isinstance(module, nn.Linear) and type(module) is not nn.Linear and module not in quantized:
            raise _not_plain_linear(name or "model", module)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None and type(base_linear(head)) is not nn.Linear:
        raise UnsupportedModelError(f"lm_head is {type(head).__name__}; only a plain torch.nn.Linear is supported")
    for name, param in model.named_parameters():
        if name in compressed:
            continue
        if param.dtype not in SUPPORTED_DTYPES:
            raise UnsupportedModelError(f"parameter {name} has dtype {param.dtype}; supported: {SUPPORTED_DTYPES}")
        if param.device.type not in SUPPORTED_DEVICES:
            raise UnsupportedModelError(f"parameter {name} is on {param.device}; supported devices: "
                                        f"{SUPPORTED_DEVICES}")
        if type(param.data) is not torch.Tensor and not (sharded and isinstance(param.data, DTensor)):
            raise UnsupportedModelError(f"parameter {name} is a {type(param.data).__name__}; only dense tensors "
                                        "are supported")
    adapters = lora_layers(model, head, quantized, sharded, absorbed_kv_b_projections(model, adapter))
    if adapters:  # LoRA layers on a model that is not a PeftModel itself (its base, or a layer wrapped by hand)
        require(kinds | {"lora"}, "model", config.model_type)
    return adapter, base, quantized, experts, adapters


# The activation names of the config field each family reads, by adapter.mlp_activation.
_ACTIVATIONS = {"silu": ("hidden_act", ("silu",)), "gelu_tanh": ("hidden_activation", ("gelu_pytorch_tanh",))}


def _check_activation(adapter, config) -> None:
    field, names = _ACTIVATIONS[adapter.mlp_activation]
    got = getattr(config, field, names[0])
    if got not in names:
        raise UnsupportedModelError(f"{config.model_type}: only the {names[0]} MLP is supported, "
                                    f"config.{field}={got!r}")


def multimodal_model(model: nn.Module) -> nn.Module:
    """A vision-language model's module holding ``visual`` and ``language_model``: ``model.model``, or the
    model itself when loaded with ``AutoModel``."""
    return model if hasattr(model, "visual") else getattr(model, "model", model)


def unpatched_modules(model: nn.Module, adapter) -> set[nn.Module]:
    """Every module under the multimodal model's ``adapter.unpatched_modules`` (towers that never run)."""
    holder = model if hasattr(model, "language_model") else getattr(model, "model", model)
    roots = [getattr(holder, name, None) for name in adapter.unpatched_modules]
    return {module for root in roots if root is not None for module in root.modules()}


def _check_vision(adapter, model: nn.Module) -> None:
    tower = getattr(multimodal_model(model), "visual", None)
    if type(tower) is not adapter.vision.tower:
        raise UnsupportedModelError(f"{adapter.model_type}: model.model.visual is {type(tower).__name__}, not the "
                                    f"{adapter.vision.tower.__name__} the adapter patches")
    problem = adapter.vision.refuse_tower(tower)
    if problem:
        raise UnsupportedModelError(f"{adapter.model_type}: {problem}")


def _check_layer_kind(adapter, layer: nn.Module, index: int, linear: bool) -> None:
    """The layer's structure (``adapter.is_linear_attention``: its projections in ``linear_attn``) is the
    kind its config gives it (``cache_specs``), so the two answers never disagree on a patched model."""
    if adapter.is_linear_attention(layer) != linear:
        held = "linear_attn" if adapter.is_linear_attention(layer) else "self_attn"
        given = "linear_attention" if linear else "an attention layer"
        raise UnsupportedModelError(f"layers.{index} holds {held} but the config's layer_types make it {given}")


def _check_linear_attention(adapter, module, name: str) -> None:
    if type(module) is not adapter.linear_attention.module:
        expected = adapter.linear_attention.module.__name__
        raise UnsupportedModelError(f"{name} is {type(module).__name__}, not the {expected} the "
                                    f"{adapter.model_type} adapter patches")
    if getattr(module, "activation", "silu") != "silu" or module.conv1d.bias is not None:
        raise UnsupportedModelError(f"{name}: only the short convolution without bias followed by silu is supported")
    if module.num_v_heads % module.num_k_heads:
        raise UnsupportedModelError(f"{name}: {module.num_v_heads} value heads do not group over "
                                    f"{module.num_k_heads} key heads")

