"""Qwen3.5-MoE (the text model, ``qwen3_5_moe_text``, also as ``AutoModelForCausalLM`` loads a
``qwen3_5_moe`` checkpoint): Qwen3.5's hybrid layers (Gated DeltaNet beside gated full attention,
zero-centred RMSNorms) with a sparse MoE block in every layer: softmax top-k routing, always
renormalised, and a dense shared expert gated per token by sigmoid(shared_expert_gate(x))."""
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (Qwen3_5MoeAttention, Qwen3_5MoeExperts,
                                                                  Qwen3_5MoeGatedDeltaNet, Qwen3_5MoeMLP,
                                                                  Qwen3_5MoeRMSNorm, Qwen3_5MoeSparseMoeBlock,
                                                                  Qwen3_5MoeTopKRouter)

from . import FamilyAdapter, LinearAttentionLayout, MoeLayout, register_family

ADAPTER = register_family(FamilyAdapter(
    model_type="qwen3_5_moe_text", config_class=Qwen3_5MoeTextConfig, rms_norm=Qwen3_5MoeRMSNorm, mlp=Qwen3_5MoeMLP,
    head_norms=("q_norm", "k_norm"),
    row_parallel=("self_attn.o_proj", "mlp.down_proj", "linear_attn.out_proj"),
    moe=MoeLayout(block=Qwen3_5MoeSparseMoeBlock, router=Qwen3_5MoeTopKRouter, experts=Qwen3_5MoeExperts,
                  normalize=lambda router: True, weights_in_logits_dtype=True, shared_expert=True),
    linear_attention=LinearAttentionLayout(Qwen3_5MoeGatedDeltaNet), gated_attention=Qwen3_5MoeAttention,
    zero_centred_norms=True,
    presets={
        # As qwen3_5_text's tiny preset, with 8 experts of 32 (top 2) and a shared expert of 96.
        "tiny": dict(hidden_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=96, num_experts=8,
                     num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                     num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                     linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                     linear_value_head_dim=32, linear_conv_kernel_dim=4, vocab_size=512,
                     max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}),
    },
))
