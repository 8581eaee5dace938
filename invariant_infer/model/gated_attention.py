"""The gated full attention of Qwen3.5 and Qwen3-Next: ``q_proj`` yields each head's query and a gate,
the attention output is multiplied by sigmoid(gate) before ``o_proj``. transformers' forward, with the
gate as a kernel (``kernels.sigmoid_mul``: every element the same code wherever it sits) and the
family's own RoPE (partial rotary, elementwise products and sums of table values)."""
from __future__ import annotations

import sys

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..kernels import sigmoid_mul
from .recomputed_backward import recomputed_backward


def gated_attention_forward(self, hidden_states: torch.Tensor, position_embeddings, attention_mask=None, **kwargs):
    cache = kwargs.pop("cache", None)
    cache = kwargs.pop("past_key_values", None) if cache is None else cache
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    query, gate = torch.chunk(self.q_proj(hidden_states).view(*input_shape, -1, self.head_dim * 2), 2, dim=-1)
    gate = gate.reshape(*input_shape, -1)
    query = self.q_norm(query.view(hidden_shape)).transpose(1, 2)
    key = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
    value = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    cos, sin = position_embeddings
    query, key = sys.modules[type(self).__module__].apply_rotary_pos_emb(query, key, cos, sin)
    if cache is not None:
        key, value = cache.update(key, value, self.layer_idx)
    attention = ALL_ATTENTION_FUNCTIONS[self.config._attn_implementation]
    out, weights = attention(self, query, key, value, attention_mask, dropout=0.0, scaling=self.scaling, **kwargs)
    out = out.reshape(*input_shape, -1).contiguous()
    gated = recomputed_backward(sigmoid_mul(out, gate), lambda o, g: (o.float() * torch.sigmoid(g.float())).to(o.dtype),
                                out, gate)
    return self.o_proj(gated), weights
