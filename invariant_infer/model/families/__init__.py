"""One adapter per model family: what ``make_invariant`` patches in it and what it refuses.

Every supported family has the Llama layout: ``model.layers[i].self_attn`` with q/k/v/o
projections, ``model.layers[i].mlp`` with gate/up/down projections and a silu activation,
RMSNorms, and one rotary embedding on the base model. In a mixture-of-experts family
(``FamilyAdapter.moe``) ``mlp`` is a sparse block instead (a router, ``gate`` or gpt-oss's
``router``, and fused 3-D ``experts``) in every layer or in some (the others keep the dense MLP).
An adapter names the family's classes and any structural refusal of its config; what a kind of model
does not run on a surface is in the support table (``invariant_infer.model.support``). Adding a
family is one file here plus its tests.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

from ...errors import UnsupportedModelError


@dataclass(frozen=True)
class MoeLayout:
    """The sparse MoE block of a family: the router (``block.gate``, or ``block.<router_attribute>``)
    and ``block.experts``."""
    block: type
    router: type                          # .weight [E, hidden], .top_k, optionally .bias [E] (see ``routing``)
    # @use_experts_implementation. "silu": gate_up_proj [E, 2I, H] ([gate; up]), down_proj [E, H, I],
    # no biases. "clamped_swiglu" (gpt-oss): gate_up_proj [E, H, 2I] with gate and up interleaved,
    # down_proj [E, I, H], biases, and (clamp(up) + 1) * g * sigmoid(alpha * g), g = min(gate, limit).
    experts: type
    normalize: Callable[[nn.Module], bool]  # whether the router renormalises its top-k weights to sum 1
    weights_in_logits_dtype: bool         # routing weights cast to the router logits' dtype (else kept in fp32)
    # A dense shared expert (the family's ``mlp`` class) added to every token's output, scaled by
    # sigmoid(shared_expert_gate(x)) (Qwen2-MoE).
    shared_expert: bool = False
    router_attribute: str = "gate"
    activation: str = "silu"
    # How the router picks and weighs experts. "softmax": top-k of softmax(x @ W.T + bias), renormalised
    # by ``normalize``. "grouped_sigmoid" (GLM-4.5, DeepSeek-V3): fp32 logits, sigmoid scores, experts
    # picked by score + ``e_score_correction_bias`` among the ``topk_group`` best of ``num_group`` groups,
    # weighted by their scores (renormalised by ``normalize``) times ``routed_scaling_factor``.
    routing: str = "softmax"
    # A dense MLP ``block.shared_experts`` (the family's ``mlp`` class) added unscaled to every token's
    # routed output (GLM-4.5, DeepSeek-V3).
    ungated_shared_experts: bool = False


@dataclass(frozen=True)
class LinearAttentionLayout:
    """A hybrid family's linear-attention layers: ``layers[i].linear_attn`` (Gated DeltaNet) where
    ``config.layer_types[i]`` is "linear_attention", ``layers[i].self_attn`` elsewhere."""
    module: type                          # the Gated DeltaNet class, whose forward make_invariant replaces
    projections: tuple[str, ...] = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")


@dataclass(frozen=True)
class VisionLayout:
    """A vision-language family's image side: the vision tower (``model.model.visual``), whose forward
    make_invariant replaces, and the multimodal model around the language model (``model.model``)."""
    tower: type
    forward: Callable                     # the tower's invariant forward
    prepare: Callable[[nn.Module], None]  # computes what the forward reads (its rope tables) into the tower's state
    refuse_tower: Callable[[nn.Module], str | None]  # why a loaded tower cannot run invariantly, or None


@dataclass(frozen=True)
class FamilyAdapter:
    model_type: str                       # config.model_type
    config_class: type
    rms_norm: type                        # every RMSNorm: layer norms, the final norm, per-head norms
    mlp: type | None                      # gate/up/down MLP: silu(gate) * up is fused into down
    attention_projections: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    # Attention projections a layer may lack (None or absent): Gemma 4's layers that reuse another
    # layer's K/V own no k/v projections, and its K = V layers no v_proj.
    optional_projections: tuple[str, ...] = ()
    mlp_projections: tuple[str, ...] = ("gate_proj", "up_proj", "down_proj")
    head_norms: tuple[str, ...] = ()      # RMSNorms inside attention, applied to each head before RoPE
    # Projections whose K tensor parallelism splits: they reduce K as the row-parallel tree.
    row_parallel: tuple[str, ...] = ("self_attn.o_proj", "mlp.down_proj")
    # Returns why a config cannot be made invariant, or None.
    refuse_config: Callable[[object], str | None] = field(default=lambda config: None)
    # Config fields of real models (their shapes) and of small test models, by name.
    presets: dict[str, dict] = field(default_factory=dict)
    moe: MoeLayout | None = None          # mixture-of-experts families only
    linear_attention: LinearAttentionLayout | None = None  # hybrid families only
    # Attention whose output is gated by sigmoid(gate) from a doubled q_proj (Qwen3.5, Qwen3-Next):
    # its class, whose forward make_invariant replaces.
    gated_attention: type | None = None
    # Multi-head latent attention (DeepSeek-V3): its class, whose forward make_invariant replaces by the
    # absorbed one (``model.latent_attention``); its layers cache one latent per token (``cache_specs``).
    latent_attention: type | None = None
    zero_centred_norms: bool = False      # every RMSNorm computes fp32 x (1 + weight) (Qwen3.5, Qwen3-Next, Gemma 3)
    # The MLP's activation: "silu" (config.hidden_act) or "gelu_tanh" (Gemma's hidden_activation
    # "gelu_pytorch_tanh").
    mlp_activation: str = "silu"
    norms_scaled_in_fp32: bool = False    # every RMSNorm computes fp32 x * weight, rounded once (gpt-oss)
    # The rotary embedding gives cos/sin for half the head dim, which the family's apply pairs with
    # the two halves of each head (gpt-oss); otherwise for the whole head dim (the halves repeated).
    rope_half_tables: bool = False
    # Vision-language families only: the vision tower; the language model is ``model.model.language_model``,
    # its config ``config.text_config``.
    vision: VisionLayout | None = None
    # Multimodal RoPE: [3, B, L] positions (temporal, height, width) each rotate their own frequencies (the
    # rotary embedding's ``mrope_section``), "sectioned" (Qwen2.5-VL) or "interleaved" (Qwen3-VL); None: text RoPE.
    mrope: str | None = None
    # A configured ``sliding_window`` applies to every layer (Mistral, Mixtral); otherwise only to the
    # layers ``layer_types`` names "sliding_attention".
    window_on_every_layer: bool = False
    # Module classes whose forward make_invariant replaces by the family's own (Gemma 4's decoder layer
    # and causal LM head), by class.
    module_forwards: dict[type, Callable] = field(default_factory=dict)
    # The causal LM applies config.final_logit_softcapping after the lm_head on the invariant path
    # (``model.logits.softcap_logits``), so the config field is supported rather than refused.
    final_logit_softcapping: bool = False
    # Submodules of the multimodal model (``model.model``) that never run and stay unpatched: Gemma 4's
    # vision and audio towers, whose inputs are refused by name.
    unpatched_modules: tuple[str, ...] = ()
    # Raises UnsupportedModelError for a loaded decoder layer (and its name) that the family's own forwards
    # would refuse when called (Gemma 4's MoE block with quantized or replaced experts), so that
    # make_invariant refuses it first.
    check_layer: Callable[[nn.Module, str], None] | None = None

    def is_sparse(self, layer: nn.Module) -> bool:
        return self.moe is not None and type(layer.mlp) is self.moe.block

    def is_linear_attention(self, layer: nn.Module) -> bool:
        """Whether a loaded decoder layer holds its projections in ``linear_attn`` (structure). Which
        layers are linear attention is ``cache_specs.linear_attention_layers(config)``; ``check_model``
        refuses a model whose layers disagree with it."""
        return self.linear_attention is not None and hasattr(layer, "linear_attn")

    def projections(self, layer: nn.Module) -> dict[str, nn.Module]:
        """The layer's projections by name (``self_attn.q_proj``, ``mlp.down_proj`` ...)."""
        mlp = layer.mlp
        if self.is_linear_attention(layer):
            found = {f"linear_attn.{name}": getattr(layer.linear_attn, name, None)
                     for name in self.linear_attention.projections}
        else:
            # A projection the module holds as None, or an optional one it lacks, is absent by its config
            # (DeepSeek's q_proj beside q_a/q_b; Gemma 4's KV-shared layers' k/v projections).
            found = {f"self_attn.{name}": getattr(layer.self_attn, name, None) for name in self.attention_projections
                     if not ((hasattr(layer.self_attn, name) or name in self.optional_projections)
                             and getattr(layer.self_attn, name, None) is None)}
        if not self.is_sparse(layer):
            found.update({f"mlp.{name}": getattr(mlp, name, None) for name in self.mlp_projections})
        return found


FAMILIES: dict[str, FamilyAdapter] = {}


def register_family(adapter: FamilyAdapter) -> FamilyAdapter:
    FAMILIES[adapter.model_type] = adapter
    return adapter


def text_config(config):
    """The language model's config: ``config.text_config`` of a vision-language model, else ``config``."""
    return getattr(config, "text_config", None) or config


def family_of(config) -> FamilyAdapter:
    """The adapter for ``config.model_type``; ``UnsupportedModelError`` for any other family."""
    model_type = getattr(config, "model_type", None)
    adapter = FAMILIES.get(model_type)
    if adapter is None:
        raise UnsupportedModelError(
            f"make_invariant supports the model types {sorted(FAMILIES)}; got model_type {model_type!r}")
    return adapter


def is_vision_language(config) -> bool:
    """Whether ``config`` is a vision-language model's: its family has a vision tower. The one answer for
    every surface (a model type outside the supported families: False; loading refuses it by name)."""
    adapter = FAMILIES.get(getattr(config, "model_type", None))
    return adapter is not None and adapter.vision is not None


def attention_setting(config, name: str | None = None):
    """``set_attn_implementation``'s argument that puts attention ``name`` (None: the current one) on the
    model, or on its text model alone where the family's towers never run (Gemma 4's audio tower takes no
    other attention than its own)."""
    adapter = FAMILIES.get(getattr(config, "model_type", None))
    if adapter is not None and adapter.unpatched_modules:
        return {"text_config": name or text_config(config)._attn_implementation}
    return name or config._attn_implementation


def rope_position_axes(config) -> int:
    """The rows of position ids the decoder's rope takes per token: 3 (temporal, height, width) for a
    multimodal rope (the family's ``mrope``), 1 otherwise."""
    adapter = FAMILIES.get(getattr(config, "model_type", None))
    return 3 if adapter is not None and adapter.mrope else 1


# Each family module registers itself.
from . import (deepseek_v3, gemma3, gemma4, gemma4_multimodal, glm4_moe, gpt_oss, llama, mistral,  # noqa: E402,F401
               mixtral, qwen2, qwen2_5_vl, qwen2_moe, qwen3, qwen3_5, qwen3_5_moe, qwen3_moe, qwen3_next, qwen3_vl)
# Encoder families: their own adapter type and registry (``encoder_adapter``).
from . import bert, modernbert, xlm_roberta  # noqa: E402,F401
from .encoder_adapter import ENCODER_FAMILIES, EncoderAdapter, encoder_family_of  # noqa: E402

__all__ = ["ENCODER_FAMILIES", "EncoderAdapter", "FAMILIES", "FamilyAdapter", "LinearAttentionLayout", "MoeLayout",
           "VisionLayout", "attention_setting", "encoder_family_of", "family_of", "is_vision_language",
           "register_family", "rope_position_axes", "text_config"]
