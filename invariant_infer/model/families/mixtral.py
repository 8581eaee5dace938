"""Mixtral (8x7B): Mistral's attention with a sparse MoE block in every layer, softmax top-k
routing always renormalised, routing weights kept in fp32; a configured ``sliding_window`` as in
Mistral (Mixtral-8x7B configs set ``sliding_window: null``)."""
from transformers import MixtralConfig
from transformers.models.mixtral.modeling_mixtral import (MixtralExperts, MixtralRMSNorm, MixtralSparseMoeBlock,
                                                          MixtralTopKRouter)

from . import FamilyAdapter, MoeLayout, register_family


ADAPTER = register_family(FamilyAdapter(
    model_type="mixtral", window_on_every_layer=True, config_class=MixtralConfig, rms_norm=MixtralRMSNorm, mlp=None,
    moe=MoeLayout(block=MixtralSparseMoeBlock, router=MixtralTopKRouter, experts=MixtralExperts,
                  normalize=lambda router: True, weights_in_logits_dtype=False),
    presets={
        "mixtral-8x7b": dict(hidden_size=4096, intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2,
                             num_attention_heads=32, num_key_value_heads=8, head_dim=128, num_hidden_layers=32,
                             vocab_size=32000, max_position_embeddings=32768, rope_theta=1000000.0,
                             rms_norm_eps=1e-5, tie_word_embeddings=False, sliding_window=None),
        "tiny": dict(hidden_size=64, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
                     num_attention_heads=4, num_key_value_heads=1, num_hidden_layers=2, vocab_size=512,
                     max_position_embeddings=512, rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                     sliding_window=None),
    },
))
