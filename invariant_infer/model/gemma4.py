"""Gemma 4's forwards that ``make_invariant`` replaces (the family: ``families.gemma4``).

* The decoder layer: transformers' own order of operations, with the per-layer input's
  gelu_tanh(gate(h)) * per_layer_input on the ``gelu_tanh_mul`` kernel (torch's CPU gelu splits
  vectorized bodies from scalar tails, which move with the batch's shape). Every other op is a
  patched module (linears, norms, attention, the MLP) or an exact elementwise add or multiply.
  Where the layer has experts (``enable_moe_block``), their output (``model.gemma4_moe``) is
  normed and added to the normed dense MLP's before ``post_feedforward_layernorm``, as transformers does.
* The causal LM: the decoder, the lm_head (the invariant linear), then ``softcap_logits``. The
  decoder is called without ``logits_to_keep``: transformers (5.25) would otherwise cut the
  KV-shared layers' rows to the kept ones while the attention bounds (``attention.invariant_mask``:
  per row, not a 4-D mask it could slice) still describe every query, so a prefill's last rows would
  attend as if they were its first. The KV-shared layers compute every row instead. Given
  ``inputs_embeds`` alone, the per-layer inputs come from the ids ``token_ids_of_embeddings`` finds.
"""
from __future__ import annotations

import dataclasses

import torch
from transformers.models.gemma4.modeling_gemma4 import Gemma4CausalLMOutputWithPast

from ..errors import NonInvariantInputError
from ..kernels import gelu_tanh_mul, gelu_tanh_mul_autograd
from .gemma4_moe import moe_forward
from .logits import softcap_logits
from .support import require


def _records_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def decoder_layer_forward(self, hidden_states: torch.Tensor, per_layer_input: torch.Tensor | None = None,
                          **kwargs) -> torch.Tensor:
    """``Gemma4TextDecoderLayer.forward``, with the MoE block (``model.gemma4_moe``) where the layer has one."""
    if _records_grad(hidden_states, self.input_layernorm.weight):
        require("gemma4_text", "training", "gemma4_text")
    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    hidden_states, _ = self.self_attn(hidden_states=hidden_states, **kwargs)
    hidden_states = residual + self.post_attention_layernorm(hidden_states)

    residual = hidden_states
    hidden_states = self.mlp(self.pre_feedforward_layernorm(hidden_states))
    if getattr(self, "enable_moe_block", False):  # the experts beside the dense MLP, as transformers adds them
        routed = self.post_feedforward_layernorm_2(moe_forward(self, residual))
        hidden_states = self.post_feedforward_layernorm_1(hidden_states) + routed
    hidden_states = residual + self.post_feedforward_layernorm(hidden_states)

    if self.hidden_size_per_layer_input:
        residual = hidden_states
        gate = self.per_layer_input_gate(hidden_states)
        per_layer_input = per_layer_input.contiguous()
        gated = gelu_tanh_mul_autograd(gate, per_layer_input) if _records_grad(gate, per_layer_input) \
            else gelu_tanh_mul(gate, per_layer_input)
        hidden_states = residual + self.post_per_layer_input_norm(self.per_layer_projection(gated))
    return hidden_states * self.layer_scalar


def token_ids_of_embeddings(embed_tokens, inputs_embeds: torch.Tensor, chunk_elements: int = 1 << 26) -> torch.Tensor:
    """The token ids whose embeddings ``inputs_embeds`` [B, L, H] are, by exact equality with the
    embedding module's own output (its weight times its scale rounded to the weight's dtype:
    transformers' reverse lookup multiplies by the unrounded sqrt(hidden), which in bf16 matches no
    row where sqrt(hidden) is not a bf16 number). Compared a block of tokens and vocabulary at a time."""
    weight = embed_tokens.weight
    table = weight * embed_tokens.embed_scale.to(weight.dtype)
    flat = inputs_embeds.reshape(-1, inputs_embeds.shape[-1]).to(table.dtype)
    hidden, vocab = table.shape[1], table.shape[0]
    vocab_block = max(1, min(vocab, chunk_elements // hidden))
    token_block = max(1, chunk_elements // (vocab_block * hidden))
    ids = torch.full((flat.shape[0],), -1, dtype=torch.long, device=flat.device)
    with torch.no_grad():
        for t0 in range(0, flat.shape[0], token_block):
            rows = flat[t0:t0 + token_block]
            for v0 in range(0, vocab, vocab_block):
                match = (rows[:, None, :] == table[None, v0:v0 + vocab_block, :]).all(-1)
                found = match.any(-1)
                first = match.int().argmax(-1) + v0
                unset = ids[t0:t0 + token_block] < 0
                ids[t0:t0 + token_block] = torch.where(found & unset, first, ids[t0:t0 + token_block])
    if bool((ids < 0).any()):
        raise NonInvariantInputError("inputs_embeds: a row is no token's embedding (embed_tokens(ids) exactly), so "
                                     "the per-layer inputs cannot be found; pass input_ids or per_layer_inputs")
    return ids.view(inputs_embeds.shape[:-1])


def causal_lm_forward(self, input_ids=None, attention_mask=None, position_ids=None, *, labels=None,
                      logits_to_keep=0, return_dict=None, **kwargs):
    """``Gemma4ForCausalLM.forward``: logits softcapped by ``config.final_logit_softcapping`` after the
    invariant lm_head."""
    base = self.model
    embeds = kwargs.get("inputs_embeds")
    if input_ids is None and embeds is not None and base.hidden_size_per_layer_input \
            and kwargs.get("per_layer_inputs") is None:
        kwargs["per_layer_inputs"] = base.get_per_layer_inputs(token_ids_of_embeddings(base.embed_tokens, embeds), None)
    outputs = base(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)
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
