"""DeepSeek-V3: multi-head latent attention (MLA) in every layer, run absorbed (``model.latent_attention``:
the engine caches one [kv_lora_rank + qk_rope_head_dim] latent per token and layer), interleaved yarn
RoPE on the rope part of each head, and dense MLPs in the first ``first_k_dense_replace`` layers. The
sparse layers (a sigmoid router with group-limited top-k, a correction bias for selection only, the
routed scaling factor, and a shared expert) are refused by name until the router is supported: a
config whose layers are all dense (``first_k_dense_replace`` = ``num_hidden_layers``) runs. The
multi-token-prediction layer (``num_nextn_predict_layers``) is not part of transformers' model and
is ignored, as transformers does."""
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (DeepseekV3Attention, DeepseekV3MLP,
                                                                  DeepseekV3RMSNorm)

from . import FamilyAdapter, register_family

# DeepSeek-V3's published rope: yarn, factor 40 over 4096 positions, mscale 1 on all dims.
_YARN = {"rope_type": "yarn", "factor": 40.0, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
         "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "rope_theta": 10000.0}


def _refuse(config) -> str | None:
    if config.first_k_dense_replace < config.num_hidden_layers:
        return ("the mixture-of-experts layers (first_k_dense_replace < num_hidden_layers) are not supported yet: "
                "their group-limited sigmoid router has no invariant kernel here; only configs whose layers are all "
                "dense run")
    return None


ADAPTER = register_family(FamilyAdapter(
    model_type="deepseek_v3", config_class=DeepseekV3Config, rms_norm=DeepseekV3RMSNorm, mlp=DeepseekV3MLP,
    attention_projections=("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"),
    latent_attention=DeepseekV3Attention, refuse_config=_refuse,
    presets={
        "deepseek-v3": dict(hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                            num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128,
                            q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                            v_head_dim=128, n_routed_experts=256, num_experts_per_tok=8, n_group=8, topk_group=4,
                            n_shared_experts=1, first_k_dense_replace=3, routed_scaling_factor=2.5,
                            norm_topk_prob=True, num_nextn_predict_layers=1, vocab_size=129280,
                            max_position_embeddings=163840, rms_norm_eps=1e-6, tie_word_embeddings=False,
                            rope_interleave=True, rope_parameters=dict(_YARN)),
        # Every layer dense; ranks small but distinct (latent 32 + rope 16 = 48, not a power of 2);
        # yarn as released over a short original context.
        "tiny": dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=32,
                     qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=24, n_routed_experts=8,
                     num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=2,
                     routed_scaling_factor=2.5, vocab_size=512, max_position_embeddings=512, rms_norm_eps=1e-6,
                     tie_word_embeddings=False, rope_interleave=True,
                     rope_parameters={**_YARN, "factor": 4.0, "original_max_position_embeddings": 128}),
    },
))
