"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention (q/k/v bias) with a sparse MoE
block whose routed experts are joined by a dense shared expert, gated per token by
sigmoid(shared_expert_gate(x)); softmax top-k routing, renormalised when ``norm_topk_prob``."""
from transformers import Qwen2MoeConfig
from transformers.models.qwen2_moe.modeling_qwen2_moe import (Qwen2MoeExperts, Qwen2MoeMLP, Qwen2MoeRMSNorm,
                                                              Qwen2MoeSparseMoeBlock, Qwen2MoeTopKRouter)

from . import FamilyAdapter, MoeLayout, register_family

ADAPTER = register_family(FamilyAdapter(
    model_type="qwen2_moe", config_class=Qwen2MoeConfig, rms_norm=Qwen2MoeRMSNorm, mlp=Qwen2MoeMLP,
    moe=MoeLayout(block=Qwen2MoeSparseMoeBlock, router=Qwen2MoeTopKRouter, experts=Qwen2MoeExperts,
                  normalize=lambda router: bool(router.norm_topk_prob), weights_in_logits_dtype=True,
                  shared_expert=True),
    presets={
        "qwen1.5-moe-a2.7b": dict(hidden_size=2048, intermediate_size=5632, moe_intermediate_size=1408,
                                  shared_expert_intermediate_size=5632, num_experts=60, num_experts_per_tok=4,
                                  norm_topk_prob=False, num_attention_heads=16, num_key_value_heads=16,
                                  num_hidden_layers=24, vocab_size=151936, max_position_embeddings=8192,
                                  rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                                  use_sliding_window=False),
        "tiny": dict(hidden_size=64, intermediate_size=160, moe_intermediate_size=32,
                     shared_expert_intermediate_size=96, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
                     num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, vocab_size=512,
                     max_position_embeddings=512, rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                     use_sliding_window=False),
    },
))
