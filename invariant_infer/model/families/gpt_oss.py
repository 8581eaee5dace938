"""gpt-oss (gpt-oss-20b, gpt-oss-120b), with bf16 or fp32 experts: sliding-window layers
(``layer_types``) beside full ones, attention sinks (one learned logit per head, ``s_aux``) in
every layer, q/k/v/o with bias, yarn RoPE applied to the two halves of each head, RMSNorms with fp32
weights scaled in fp32, and a sparse MoE block in every layer: a router with bias (softmax over the
top-k logits: the renormalised top-k of the full softmax), and experts with interleaved gate/up
columns, biases and the clamped SwiGLU. The released checkpoints store the experts in MXFP4, which
the support table refuses by name: load them with ``Mxfp4Config(dequantize=True)`` for bf16 experts."""
from transformers import GptOssConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts, GptOssMLP, GptOssRMSNorm, GptOssTopKRouter

from . import FamilyAdapter, MoeLayout, register_family

_YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
         "original_max_position_embeddings": 4096, "rope_theta": 150000.0}


ADAPTER = register_family(FamilyAdapter(
    model_type="gpt_oss", config_class=GptOssConfig, rms_norm=GptOssRMSNorm, mlp=None,
    moe=MoeLayout(block=GptOssMLP, router=GptOssTopKRouter, experts=GptOssExperts, normalize=lambda router: True,
                  weights_in_logits_dtype=True, router_attribute="router", activation="clamped_swiglu"),
    norms_scaled_in_fp32=True, rope_half_tables=True,
    presets={
        "gpt-oss-20b": dict(hidden_size=2880, intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4,
                            num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_hidden_layers=24,
                            sliding_window=128, vocab_size=201088, max_position_embeddings=131072,
                            rms_norm_eps=1e-5, tie_word_embeddings=False, rope_parameters=dict(_YARN)),
        # One sliding layer (a window of 24 keys) and one full, as the released models alternate;
        # top-4 of 8 experts; yarn as released, over a shorter original context.
        "tiny": dict(hidden_size=64, intermediate_size=32, num_local_experts=8, num_experts_per_tok=4,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_hidden_layers=2,
                     layer_types=["sliding_attention", "full_attention"], sliding_window=24, vocab_size=512,
                     max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=False,
                     rope_parameters={**_YARN, "factor": 4.0, "original_max_position_embeddings": 128}),
    },
))
