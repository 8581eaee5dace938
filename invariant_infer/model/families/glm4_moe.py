"""GLM-4.5 / GLM-4.6 (``glm4_moe``: GLM-4.5-Air, GLM-4.5, GLM-4.6): Llama-style attention with q/k/v
bias, RoPE on the first half of each head (``partial_rotary_factor`` 0.5), per-head q/k RMSNorms when
``use_qk_norm``; the first ``first_k_dense_replace`` layers keep a dense MLP, the others a sparse block
of routed experts plus an ungated shared MLP (``shared_experts``). The router is DeepSeek-V3's: fp32
logits, sigmoid scores, experts chosen by score + ``e_score_correction_bias`` among the ``topk_group``
best of ``n_group`` groups, weighted by their scores (renormalised when ``norm_topk_prob``) times
``routed_scaling_factor``. The causal LM does not load the checkpoints' multi-token-prediction layers;
``generate(use_mtp=True)`` is refused with the other assisted decoding."""
from transformers import Glm4MoeConfig
from transformers.models.glm4_moe.modeling_glm4_moe import (Glm4MoeExperts, Glm4MoeMLP, Glm4MoeMoE, Glm4MoeRMSNorm,
                                                            Glm4MoeTopkRouter)

from . import FamilyAdapter, MoeLayout, register_family


ADAPTER = register_family(FamilyAdapter(
    model_type="glm4_moe", config_class=Glm4MoeConfig, rms_norm=Glm4MoeRMSNorm, mlp=Glm4MoeMLP,
    head_norms=("q_norm", "k_norm"),  # when use_qk_norm (GLM-4.5, GLM-4.6; not GLM-4.5-Air)
    moe=MoeLayout(block=Glm4MoeMoE, router=Glm4MoeTopkRouter, experts=Glm4MoeExperts,
                  normalize=lambda router: bool(router.norm_topk_prob), weights_in_logits_dtype=False,
                  routing="grouped_sigmoid", ungated_shared_experts=True),
    presets={
        # zai-org/GLM-4.5-Air's config.json.
        "glm-4.5-air": dict(hidden_size=4096, intermediate_size=10944, moe_intermediate_size=1408, head_dim=128,
                            num_attention_heads=96, num_key_value_heads=8, num_hidden_layers=46,
                            n_routed_experts=128, num_experts_per_tok=8, n_shared_experts=1, n_group=1, topk_group=1,
                            first_k_dense_replace=1, routed_scaling_factor=1.0, norm_topk_prob=True,
                            use_qk_norm=False, attention_bias=True, vocab_size=151552,
                            max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False,
                            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                             "partial_rotary_factor": 0.5}),
        # Layer 0 dense, layer 1 sparse: 8 experts in 2 groups of 4, one group kept, top-2; q/k norms;
        # routed_scaling_factor 2.5 so that a reference without it misses.
        "tiny": dict(hidden_size=64, intermediate_size=160, moe_intermediate_size=32, head_dim=32,
                     num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, n_routed_experts=8,
                     num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1,
                     routed_scaling_factor=2.5, norm_topk_prob=True, use_qk_norm=True, attention_bias=True,
                     vocab_size=512, max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=False,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
    },
))
