"""Qwen3-Next (Qwen3-Next-80B-A3B): Qwen3.5's hybrid layers (Gated DeltaNet beside gated full
attention, zero-centred RMSNorms, partial rotary) with the Gated DeltaNet projections fused in two,
``in_proj_qkvz`` and ``in_proj_ba``, interleaved per key head, and a sparse MoE block (softmax top-k
routing, renormalised when ``norm_topk_prob``, and a dense shared expert gated per token by
sigmoid(shared_expert_gate(x))); layers in ``mlp_only_layers`` keep a dense MLP."""
from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig
from transformers.models.qwen3_next.modeling_qwen3_next import (Qwen3NextAttention, Qwen3NextExperts,
                                                                Qwen3NextGatedDeltaNet, Qwen3NextMLP,
                                                                Qwen3NextRMSNorm, Qwen3NextSparseMoeBlock,
                                                                Qwen3NextTopKRouter)

from . import FamilyAdapter, LinearAttentionLayout, MoeLayout, register_family

ADAPTER = register_family(FamilyAdapter(
    model_type="qwen3_next", config_class=Qwen3NextConfig, rms_norm=Qwen3NextRMSNorm, mlp=Qwen3NextMLP,
    head_norms=("q_norm", "k_norm"),
    row_parallel=("self_attn.o_proj", "mlp.down_proj", "linear_attn.out_proj"),
    moe=MoeLayout(block=Qwen3NextSparseMoeBlock, router=Qwen3NextTopKRouter, experts=Qwen3NextExperts,
                  normalize=lambda router: bool(router.norm_topk_prob), weights_in_logits_dtype=True,
                  shared_expert=True),
    linear_attention=LinearAttentionLayout(Qwen3NextGatedDeltaNet,
                                           projections=("in_proj_qkvz", "in_proj_ba", "out_proj")),
    gated_attention=Qwen3NextAttention, zero_centred_norms=True,
    presets={
        # As qwen3_5_moe_text's tiny preset (one Gated DeltaNet layer, one gated attention layer), each
        # with a sparse block of 8 experts of 32 (top 2, renormalised) and a shared expert of 96.
        "tiny": dict(hidden_size=64, intermediate_size=160, moe_intermediate_size=32,
                     shared_expert_intermediate_size=96, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                     decoder_sparse_step=1, mlp_only_layers=[], num_attention_heads=4, num_key_value_heads=2,
                     head_dim=32, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                     linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                     linear_value_head_dim=32, linear_conv_kernel_dim=4, vocab_size=512,
                     max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}),
    },
))
