"""Qwen3-MoE (Qwen3-30B-A3B): Qwen3's attention (per-head q/k norms) with a sparse MoE block,
softmax top-k routing renormalised when ``norm_topk_prob``; layers in ``mlp_only_layers`` or
off the ``decoder_sparse_step`` keep a dense MLP."""
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import (Qwen3MoeExperts, Qwen3MoeMLP, Qwen3MoeRMSNorm,
                                                              Qwen3MoeSparseMoeBlock, Qwen3MoeTopKRouter)

from . import FamilyAdapter, MoeLayout, register_family

ADAPTER = register_family(FamilyAdapter(
    model_type="qwen3_moe", config_class=Qwen3MoeConfig, rms_norm=Qwen3MoeRMSNorm, mlp=Qwen3MoeMLP,
    head_norms=("q_norm", "k_norm"),
    moe=MoeLayout(block=Qwen3MoeSparseMoeBlock, router=Qwen3MoeTopKRouter, experts=Qwen3MoeExperts,
                  normalize=lambda router: bool(router.norm_topk_prob), weights_in_logits_dtype=True),
    presets={
        "qwen3-30b-a3b": dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                              num_experts_per_tok=8, norm_topk_prob=True, num_attention_heads=32,
                              num_key_value_heads=4, head_dim=128, num_hidden_layers=48, vocab_size=151936,
                              max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                              tie_word_embeddings=False, use_sliding_window=False),
        # Layer 1 is dense (mlp_only_layers), so both MLP paths run; top-4 of 8 exercises the
        # combine order beyond a pair.
        "tiny": dict(hidden_size=64, intermediate_size=160, moe_intermediate_size=32, num_experts=8,
                     num_experts_per_tok=4, norm_topk_prob=True, mlp_only_layers=[1], num_attention_heads=4,
                     num_key_value_heads=2, head_dim=32, num_hidden_layers=2, vocab_size=512,
                     max_position_embeddings=512, rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                     use_sliding_window=False),
    },
))
