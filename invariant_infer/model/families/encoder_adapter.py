"""The adapter of an encoder family (BERT, XLM-RoBERTa, ModernBERT): bidirectional self-attention layers
under a base model (``BertModel``), an optional pooler, and the classes ``make_invariant`` runs on it.

An encoder has none of the decoder layout ``FamilyAdapter`` describes (no rotary embedding, no
gate/up/down MLP, LayerNorm instead of RMSNorm), so its adapter is a type of its own, in its own
registry: the decoder surfaces (loading, the engine, generate) never see an encoder family.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ...errors import UnsupportedModelError

# The activations of the intermediate layer the gelu kernel computes: config.hidden_act -> its form.
GELU_FORMS = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}


@dataclass(frozen=True)
class EncoderAdapter:
    model_type: str                        # config.model_type
    config_class: type
    base: type                             # the base model (``AutoModel``): embeddings, encoder.layer, pooler
    layer: type                            # each ``encoder.layer[i]``
    self_attention: type                   # ``layer.attention.self``: runs through the attention interface
    intermediate: type                     # ``layer.intermediate``: dense, then the activation
    pooler: type                           # dense + tanh on the first token
    # The classes make_invariant runs: the base model and its sequence-classification model.
    architectures: tuple[type, ...]
    # The sequence-classification head, when it is a module of its own (XLM-R: dense, tanh, out_proj on the
    # first token); None where the head is the pooler and a Linear (BERT).
    classification_head: type | None = None
    # Position ids count from the padding index (XLM-R: padding_idx + 1 for the first real token, pads at
    # padding_idx), else from 0 (BERT, pads at 0).
    positions_after_padding_idx: bool = False
    # Which forwards patch it: "bert" (``model.encoder``: encoder.layer[i].attention.self, intermediate, pooler)
    # or "modernbert" (``model.modernbert``: rotary positions, local and global layers, a GeGLU MLP).
    layout: str = "bert"
    refuse_config: Callable[[object], str | None] = field(default=lambda config: None)
    presets: dict[str, dict] = field(default_factory=dict)


ENCODER_FAMILIES: dict[str, EncoderAdapter] = {}

# Encoder model types refused by name, with why.
REFUSED_ENCODERS: dict[str, str] = {}


def register_encoder_family(adapter: EncoderAdapter) -> EncoderAdapter:
    ENCODER_FAMILIES[adapter.model_type] = adapter
    return adapter


def encoder_family_of(config) -> EncoderAdapter | None:
    """The adapter of an encoder config, None for any other; ``UnsupportedModelError`` for an encoder
    refused by name."""
    model_type = getattr(config, "model_type", None)
    if model_type in REFUSED_ENCODERS:
        raise UnsupportedModelError(f"{model_type}: {REFUSED_ENCODERS[model_type]}")
    return ENCODER_FAMILIES.get(model_type)


def refuse_encoder_config(config) -> str | None:
    """What neither encoder family runs: a decoder or cross-attention configuration, relative position
    embeddings, an activation the gelu kernel does not compute."""
    if getattr(config, "is_decoder", False) or getattr(config, "add_cross_attention", False):
        return ("is_decoder / add_cross_attention make it a causal decoder with cross-attention; only the "
                "bidirectional encoder is supported")
    position = getattr(config, "position_embedding_type", "absolute")
    if position not in (None, "absolute"):
        return f"position_embedding_type {position!r} is not supported; only absolute position embeddings are"
    if config.hidden_act not in GELU_FORMS:
        return f"hidden_act {config.hidden_act!r} is not supported; supported: {sorted(GELU_FORMS)}"
    return None
