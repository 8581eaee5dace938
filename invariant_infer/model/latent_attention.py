"""Multi-head latent attention (DeepSeek-V3's MLA), absorbed, in prefill and decode alike.

transformers caches per token the normalised latent c [r] (``kv_a_layernorm`` of the first r columns of
``kv_a_proj_with_mqa``) and the rope key k_rope, and expands them through ``kv_b_proj`` into every head's
key [k_nope, k_rope] and value before attention. Here the expansion is absorbed into the query and the
output instead: with ``kv_b_proj.weight`` viewed as [H, qk_nope + v_head, r], head h's W_uk [qk_nope, r]
and W_uv [v_head, r],

    q . k = q_nope . (W_uk c) + q_rope . k_rope = (W_uk^T q_nope) . c + q_rope . k_rope
    sum_j p_j (W_uv c_j) = W_uv (sum_j p_j c_j)

so the query is [W_uk^T q_nope, q_rope] (dim r + rope), every head shares one key per token
[c, k_rope] (MQA: Hkv = 1), the value is that same key (the output's first r columns are
sum_j p_j c_j, the last rope ones are dropped), and head h's output is W_uv o_lat. One arithmetic for
prefill and decode, so a decode step's bits are the prefill row's, and a cache holds one
[r + rope] vector per token: transformers' caches hold (c, k_rope) as its "key" and "value", as the
stock forward stores them, and the engine one latent page tensor (``cache_specs.LatentAttentionSpec``).

The per-head products run on the grouped GEMM (``kernels.grouped_linear``) with heads as groups: rows
sorted by head, each row bitwise what it gives alone, so no row's bits depend on how many tokens the
call holds. The weights are strided views of ``kv_b_proj.weight``: nothing is copied or kept, except
in transformers' fp8 format, where ``kv_b_proj`` is an ``FP8Linear`` that the absorbed forward never
calls: ``make_invariant`` dequantizes its weight once to the activation dtype (``quantization.dequantize_fp8``)
and keeps it in the projection's ``ModuleState`` (``dequantized_weight``, which ``restore`` removes), so
the per-head products run in that dtype on the grouped GEMM, as for a bf16 checkpoint.
"""
from __future__ import annotations

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..kernels import grouped_linear
from .module_state import state_of
from .support import require


def _per_head(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [B, L, H, K] @ weight[h]^T per head ([H, N, K]) -> [B, L, H, N], on the grouped GEMM."""
    batch, length, heads, k = x.shape
    rows = x.permute(2, 0, 1, 3).reshape(heads * batch * length, k)
    offsets = torch.arange(heads + 1, device=x.device, dtype=torch.int64) * (batch * length)
    out = grouped_linear(rows, weight, offsets, offsets_valid=True)
    return out.view(heads, batch, length, -1).permute(1, 2, 0, 3)


def absorbed_weights(module) -> tuple[torch.Tensor, torch.Tensor]:
    """(W_uk^T [H, r, qk_nope], W_uv [H, v_head, r]): views of ``kv_b_proj.weight`` (or of its weight
    dequantized at ``make_invariant``) as linear weights."""
    state = state_of(module.kv_b_proj)
    weight = module.kv_b_proj.weight if state is None or state.dequantized_weight is None else state.dequantized_weight
    weight = weight.view(module.num_heads, module.qk_nope_head_dim + module.v_head_dim, module.kv_lora_rank)
    return weight[:, :module.qk_nope_head_dim].transpose(1, 2), weight[:, module.qk_nope_head_dim:]


# Why no LoRA may target kv_b_proj: its weight is read absorbed, so an unmerged delta would be dropped.
KV_B_LORA_REASON = ("LoRA on kv_b_proj is not supported: multi-head latent attention reads its weight absorbed into "
                    "the query and the output and never calls the layer, so an unmerged adapter there would be "
                    "ignored; target q_a_proj, q_b_proj, kv_a_proj_with_mqa or o_proj, or merge the adapter")


def absorbed_kv_b_projections(model, adapter) -> set:
    """Every latent attention's kv_b_proj (read as weights, never called), empty for other families."""
    if adapter is None or adapter.latent_attention is None:
        return set()
    return {m.kv_b_proj for m in model.modules() if type(m) is adapter.latent_attention}


def absorbed_projections(model, adapter, quantized: dict) -> dict:
    """{kv_b_proj: its plan} of each latent attention whose kv_b_proj is quantized: the absorbed forward
    reads it as float weights and never runs it, so it leaves ``quantized`` (no quantized forward is
    claimed for it) and runs on its weight dequantized once."""
    if adapter.latent_attention is None:
        return {}
    return {m.kv_b_proj: quantized.pop(m.kv_b_proj) for m in model.modules()
            if type(m) is adapter.latent_attention and m.kv_b_proj in quantized}


def rotate(module, q_rot: torch.Tensor, k_rot: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """transformers' rope of the family (interleaved pairs where ``config.rope_interleave``), elementwise."""
    if module.config.rope_interleave:
        cos, sin = cos[..., :cos.shape[-1] // 2].unsqueeze(1), sin[..., :sin.shape[-1] // 2].unsqueeze(1)
        q1, q2, k1, k2 = q_rot[..., 0::2], q_rot[..., 1::2], k_rot[..., 0::2], k_rot[..., 1::2]
        return (torch.cat([q1 * cos - q2 * sin, q2 * cos + q1 * sin], dim=-1),
                torch.cat([k1 * cos - k2 * sin, k2 * cos + k1 * sin], dim=-1))
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)

    def half(x):
        return torch.cat((-x[..., x.shape[-1] // 2:], x[..., :x.shape[-1] // 2]), dim=-1)
    return q_rot * cos + half(q_rot) * sin, k_rot * cos + half(k_rot) * sin


def latent_attention_forward(self, hidden_states: torch.Tensor, position_embeddings, attention_mask=None, **kwargs):
    cache = kwargs.pop("cache", None)
    cache = kwargs.pop("past_key_values", None) if cache is None else cache
    if torch.is_grad_enabled() and (hidden_states.requires_grad or any(p.requires_grad for p in self.parameters())):
        require("latent_attention", "training", self.config.model_type)  # the grouped GEMM has no backward
    batch, length = hidden_states.shape[:-1]
    rank, rope, nope = self.kv_lora_rank, self.qk_rope_head_dim, self.qk_nope_head_dim
    if self.q_lora_rank is None:
        q = self.q_proj(hidden_states)
    else:
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
    q = q.view(batch, length, self.num_heads, nope + rope)
    q_nope, q_rot = q[..., :nope], q[..., nope:].transpose(1, 2)
    compressed = self.kv_a_proj_with_mqa(hidden_states)
    latent = self.kv_a_layernorm(compressed[..., :rank].contiguous()).view(batch, 1, length, rank)
    k_rot = compressed[..., rank:].reshape(batch, 1, length, rope)
    cos, sin = position_embeddings
    q_rot, k_rot = rotate(self, q_rot, k_rot, cos, sin)
    if cache is not None:  # transformers' convention: the latent as "key", the rope key as "value"
        latent, k_rot = cache.update(latent, k_rot, self.layer_idx)
    key = torch.cat((latent, k_rot), dim=-1)                      # [B, 1, Lk, r + rope]
    w_uk, w_uv = absorbed_weights(self)
    query = torch.cat((_per_head(q_nope, w_uk).transpose(1, 2), q_rot), dim=-1)  # [B, H, L, r + rope]
    attention = ALL_ATTENTION_FUNCTIONS[self.config._attn_implementation]
    out, weights = attention(self, query, key, key, attention_mask,
                             dropout=self.attention_dropout if self.training else 0.0, scaling=self.scaling,
                             **kwargs)
    heads = _per_head(out[..., :rank], w_uv)                      # [B, L, H, v_head]
    return self.o_proj(heads.reshape(batch, length, -1)), weights
