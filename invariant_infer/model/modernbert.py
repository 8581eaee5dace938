"""ModernBERT encoders on the invariant kernels: what ``make_invariant`` checks and patches on a model of the
``modernbert`` family (``families.modernbert``).

  * every ``nn.Linear`` -> the invariant linear; every ``nn.LayerNorm`` (bias-free) -> the ``layer_norm``
    kernel;
  * the MLP: ``Wi``, then gelu(input) on the ``gelu`` kernel times the gate (one correctly rounded product
    per element), then ``Wo``;
  * the rotary embedding -> a cos/sin table per layer type (the global and the local theta), read at each
    row's own positions: ``cumsum(mask) - 1``, pads at 0, on either padding side (stock counts columns);
  * attention -> the ``invariant_modernbert`` attention function: a global layer's query sees every real
    key of its row, a local layer's the real keys at most ``local_attention // 2`` positions away on
    either side (``attention.attend_bidirectional``). The base model's pre-hook hands both layer types
    each row's bounds as a per-layer-type mapping, so transformers builds no mask and unpads nothing;
  * ``ModernBertForSequenceClassification``: the pooling on the kernels (the row's first real token for
    "cls", where stock takes the first column, a pad under left padding; the pooling kernel for "mean"),
    then dense, the gelu kernel and the norm of the head, then the classifier.
Inference only (``modernbert_training``): the GeGLU MLP and the head run forward-only kernels.
"""
from __future__ import annotations

import functools

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.modeling_outputs import SequenceClassifierOutput

from ..errors import NonInvariantInputError, UnsupportedModelError
from ..kernels import gelu
from .attention import attend_bidirectional, refuse_softcapping
from .encoder import (_layer_norm_forward, _padding_mask, _refuse_training, _tokens, check_encoder_class,
                      check_encoder_modules)
from .families.encoder_adapter import GELU_FORMS, EncoderAdapter
from .input_checks import bind_forward_arguments
from .padding import is_sequence_bounds, sequence_bounds
from .pooling import pool
from .rope import rotary_forward, set_rope_tables
from .support import require

ATTN_IMPLEMENTATION = "invariant_modernbert"
LAYER_TYPES = ("full_attention", "sliding_attention")


def check_modernbert(model: nn.Module, adapter: EncoderAdapter) -> nn.Module:
    """Refuse, by name, what the ModernBERT forwards would not compute exactly; returns the base model."""
    config = model.config
    base = check_encoder_class(model, adapter)
    for index, layer in enumerate(base.layers):
        local = config.layer_types[index] == "sliding_attention"
        if type(layer) is not adapter.layer or type(layer.attn) is not adapter.self_attention \
                or type(layer.mlp) is not adapter.intermediate \
                or getattr(layer.attn, "sliding_window", "absent") != (config.sliding_window + 1 if local else None):
            raise UnsupportedModelError(f"{adapter.model_type}: layers.{index} is not the "
                                        f"{adapter.layer.__name__} layout the adapter patches")
    if model is not base and type(model.head) is not adapter.pooler:
        raise UnsupportedModelError(f"{adapter.model_type}: the head is {type(model.head).__name__}")
    check_encoder_modules(model, layer_norm_bias=False)
    return base


# ---- per-module forwards ---------------------------------------------------------------------------

def _mlp_forward(self, hidden_states: torch.Tensor, approximate: str) -> torch.Tensor:
    # Dropout is the identity in eval mode (train mode is refused at the entry).
    inputs, gate = self.Wi(hidden_states).chunk(2, dim=-1)
    return self.Wo(gelu(inputs, approximate=approximate) * gate)


def _head_forward(self, hidden_states: torch.Tensor, approximate: str) -> torch.Tensor:
    return self.norm(gelu(self.dense(hidden_states), approximate=approximate))


def _classifier_forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None,
                        labels=None, return_dict=None, **kwargs):
    """``ModernBertForSequenceClassification.forward`` with each row pooled over its own real tokens."""
    outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         inputs_embeds=inputs_embeds, **kwargs)
    mask = attention_mask if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2 else None
    pooled = pool(outputs[0], mask, self.config.classifier_pooling)
    logits = self.classifier(self.drop(self.head(pooled)))
    loss = None if labels is None else self.loss_function(labels=labels, pooled_logits=logits, config=self.config)
    out = SequenceClassifierOutput(loss=loss, logits=logits, hidden_states=outputs.hidden_states,
                                   attentions=outputs.attentions)
    return out.to_tuple() if return_dict is False else out


def modernbert_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                         sliding_window=None, **kwargs):
    """transformers attention function of ``ModernBertAttention``: q [B, H, L, D], k/v [B, H, L, D] ->
    ([B, L, H, D], None). A local layer's window comes from the config (its keys at most
    ``config.sliding_window`` = local_attention // 2 positions away, as transformers' bidirectional
    sliding-window mask), not from ``sliding_window``, which is flash attention's inclusive bound."""
    refuse_softcapping(kwargs)
    if not is_sequence_bounds(attention_mask):
        raise NonInvariantInputError("invariant ModernBERT attention needs the 2-D padding mask (or none); a "
                                     "prepared mask was passed")
    if dropout:
        raise NonInvariantInputError("attention dropout is not batch-invariant; call model.eval()")
    config = module.config
    half = config.sliding_window if config.layer_types[module.layer_idx] == "sliding_attention" else None
    kv_start, kv_end, _ = attention_mask[:, :, 0, 0].unbind(0)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return attend_bidirectional(query, key, value, kv_start, kv_end, scale, half), None


# ---- input handling ------------------------------------------------------------------------------

def _base_pre_hook(module, args, kwargs):
    """On the base model: each row's positions and attention bounds from its own mask."""
    kwargs = bind_forward_arguments(module, args, kwargs)
    _refuse_training(module)
    embeds = kwargs.get("inputs_embeds")
    if torch.is_grad_enabled() and (any(p.requires_grad for p in module.parameters())
                                    or (isinstance(embeds, torch.Tensor) and embeds.requires_grad)):
        # Whatever the encoder row allows: the GeGLU and the head run forward-only kernels here.
        require("modernbert_training", "training", "modernbert")
    tokens = _tokens(kwargs)
    if tokens is None:
        return (), kwargs
    batch, width = tokens.shape[:2]
    mask = _padding_mask(kwargs, tokens)
    limit = module.config.max_position_embeddings
    positions = kwargs.get("position_ids")
    if positions is None:
        if width > limit:
            raise NonInvariantInputError(f"{width} tokens are more than max_position_embeddings ({limit})")
        kwargs["position_ids"] = (mask.to(torch.long).cumsum(-1) - 1).masked_fill(mask == 0, 0)
    elif bool(((positions < 0) | (positions >= limit)).any()):
        raise NonInvariantInputError(f"position_ids outside [0, max_position_embeddings = {limit})")
    bounds = sequence_bounds(mask, batch, width, 0, tokens.device)
    kwargs["attention_mask"] = {layer_type: bounds for layer_type in LAYER_TYPES}
    return (), kwargs


# ---- patching ------------------------------------------------------------------------------------

def patch_modernbert(model: nn.Module, adapter: EncoderAdapter, linear_forward, set_forward) -> tuple[list, str]:
    """Check, then patch ``model`` in place; returns (hook handles, the config's attention implementation
    before the patch). ``set_forward(module, fn)`` records each replaced forward for ``restore``."""
    base = check_modernbert(model, adapter)
    config = model.config
    mlp = functools.partial(_mlp_forward, approximate=GELU_FORMS[config.hidden_activation])
    head = functools.partial(_head_forward, approximate=GELU_FORMS[config.classifier_activation])
    for module in model.modules():
        if type(module) is nn.Linear:
            set_forward(module, linear_forward)
        elif type(module) is nn.LayerNorm:
            set_forward(module, _layer_norm_forward)
        elif type(module) is adapter.intermediate:
            set_forward(module, mlp)
        elif type(module) is adapter.pooler:
            set_forward(module, head)
    if model is not base:
        set_forward(model, _classifier_forward)
    set_rope_tables(base.rotary_emb, config.max_position_embeddings)
    set_forward(base.rotary_emb, rotary_forward)
    hooks = [base.register_forward_pre_hook(_base_pre_hook, with_kwargs=True)]
    AttentionInterface.register(ATTN_IMPLEMENTATION, modernbert_attention)
    previous = config._attn_implementation
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return hooks, previous
