"""Gemma 4's forwards that ``make_invariant`` replaces (the family: ``families.gemma4``).

* The decoder layer: transformers' own order of operations, with the per-layer input's
  gelu_tanh(gate(h)) * per_layer_input on the ``gelu_tanh_mul`` kernel (torch's CPU gelu splits
  vectorized bodies from scalar tails, which move with the batch's shape). Every other op is a
  patched module (linears, norms, attention, the MLP) or an exact elementwise add or multiply.
* The causal LM: the decoder, the lm_head (the invariant linear), then ``softcap_logits``. The
  decoder is called without ``logits_to_keep``: transformers (5.25) would otherwise cut the
  KV-shared layers' rows to the kept ones while the attention bounds (``attention.invariant_mask``:
  per row, not a 4-D mask it could slice) still describe every query, so a prefill's last rows would
  attend as if they were its first. The KV-shared layers compute every row instead.
"""
from __future__ import annotations

import dataclasses

import torch
from transformers.models.gemma4.modeling_gemma4 import Gemma4CausalLMOutputWithPast

from ..kernels import gelu_tanh_mul, gelu_tanh_mul_autograd
from .logits import softcap_logits


def _records_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def decoder_layer_forward(self, hidden_states: torch.Tensor, per_layer_input: torch.Tensor | None = None,
                          **kwargs) -> torch.Tensor:
    """``Gemma4TextDecoderLayer.forward`` (dense: the MoE block is refused by the adapter)."""
    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    hidden_states, _ = self.self_attn(hidden_states=hidden_states, **kwargs)
    hidden_states = residual + self.post_attention_layernorm(hidden_states)

    residual = hidden_states
    hidden_states = self.mlp(self.pre_feedforward_layernorm(hidden_states))
    hidden_states = residual + self.post_feedforward_layernorm(hidden_states)

    if self.hidden_size_per_layer_input:
        residual = hidden_states
        gate = self.per_layer_input_gate(hidden_states)
        per_layer_input = per_layer_input.contiguous()
        gated = gelu_tanh_mul_autograd(gate, per_layer_input) if _records_grad(gate, per_layer_input) \
            else gelu_tanh_mul(gate, per_layer_input)
        hidden_states = residual + self.post_per_layer_input_norm(self.per_layer_projection(gated))
    return hidden_states * self.layer_scalar


def causal_lm_forward(self, input_ids=None, attention_mask=None, position_ids=None, *, labels=None,
                      logits_to_keep=0, return_dict=None, **kwargs):
    """``Gemma4ForCausalLM.forward``: logits softcapped by ``config.final_logit_softcapping`` after the
    invariant lm_head."""
    outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)
    hidden = outputs.last_hidden_state
    kept = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
    logits = self.lm_head(hidden[:, kept, :])
    if self.config.final_logit_softcapping is not None:
        logits = softcap_logits(logits, self.config.final_logit_softcapping)
    loss = None
    if labels is not None:
        loss = self.loss_function(logits, labels, self.vocab_size, **kwargs)
    names = {f.name for f in dataclasses.fields(Gemma4CausalLMOutputWithPast)}
    carried = {name: value for name, value in outputs.items() if name in names and name != "last_hidden_state"}
    result = Gemma4CausalLMOutputWithPast(loss=loss, logits=logits, **carried)
    return result.to_tuple() if return_dict is False else result
