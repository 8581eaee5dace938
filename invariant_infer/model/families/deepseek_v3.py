"""DeepSeek-V3: multi-head latent attention (MLA) in every layer, run absorbed (``model.latent_attention``:
the engine caches one [kv_lora_rank + qk_rope_head_dim] latent per token and layer), interleaved yarn
RoPE on the rope part of each head; the first ``first_k_dense_replace`` layers keep a dense MLP, the
others a sparse block of routed experts plus an ungated shared MLP (``shared_experts``), routed as
GLM-4.5 routes (``MoeLayout.routing`` "grouped_sigmoid": fp32 logits, sigmoid scores, experts chosen by
score + ``e_score_correction_bias`` among the ``topk_group`` best of ``n_group`` groups, weighted by
their scores, renormalised when ``norm_topk_prob``, times ``routed_scaling_factor``). The
multi-token-prediction layer (``num_nextn_predict_layers``) is not part of transformers' model and is
ignored, as transformers does."""
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (DeepseekV3Attention, DeepseekV3Experts,
                                                                  DeepseekV3MLP, DeepseekV3MoE, DeepseekV3RMSNorm,
                                                                  DeepseekV3TopkRouter)

from . import FamilyAdapter, MoeLayout, register_family

# DeepSeek-V3's published rope: yarn, factor 40 over 4096 positions, mscale 1 on all dims.
_YARN = {"rope_type": "yarn", "factor": 40.0, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
         "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "rope_theta": 10000.0}


ADAPTER = register_family(FamilyAdapter(
    model_type="deepseek_v3", config_class=DeepseekV3Config, rms_norm=DeepseekV3RMSNorm, mlp=DeepseekV3MLP,
    attention_projections=("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"),
    latent_attention=DeepseekV3Attention,
    moe=MoeLayout(block=DeepseekV3MoE, router=DeepseekV3TopkRouter, experts=DeepseekV3Experts,
                  normalize=lambda router: bool(router.norm_topk_prob), weights_in_logits_dtype=False,
                  routing="grouped_sigmoid", ungated_shared_experts=True),
    presets={
        "deepseek-v3": dict(hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                            num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128,
                            q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                            v_head_dim=128, n_routed_experts=256, num_experts_per_tok=8, n_group=8, topk_group=4,
                            n_shared_experts=1, first_k_dense_replace=3, routed_scaling_factor=2.5,
                            norm_topk_prob=True, num_nextn_predict_layers=1, vocab_size=129280,
                            max_position_embeddings=163840, rms_norm_eps=1e-6, tie_word_embeddings=False,
                            rope_interleave=True, rope_parameters=dict(_YARN)),
        # Layer 0 dense, layer 1 sparse: 8 experts in 2 groups of 4, one group kept, top-2, scaled by 2.5;
        # ranks small but distinct (latent 32 + rope 16 = 48, not a power of 2); yarn as released over a
        # short original context.
        "tiny": dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=32,
                     qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=24, n_routed_experts=8,
                     num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=1,
                     routed_scaling_factor=2.5, norm_topk_prob=True, vocab_size=512, max_position_embeddings=512,
                     rms_norm_eps=1e-6, tie_word_embeddings=False, rope_interleave=True,
                     rope_parameters={**_YARN, "factor": 4.0, "original_max_position_embeddings": 128}),
    },
))
