"""Qwen3: RMSNorm on each query and key head before RoPE, an explicit head_dim (may differ from
hidden_size / num_attention_heads), no attention bias by default, tied embeddings in the small models."""
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm

from . import FamilyAdapter, register_family

ADAPTER = register_family(FamilyAdapter(
    model_type="qwen3", config_class=Qwen3Config, rms_norm=Qwen3RMSNorm, mlp=Qwen3MLP,
    head_norms=("q_norm", "k_norm"),
    presets={
        "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=128, num_hidden_layers=36, vocab_size=151936, max_position_embeddings=40960,
                         rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False),
        "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_attention_heads=16, num_key_value_heads=8,
                           head_dim=128, num_hidden_layers=28, vocab_size=151936, max_position_embeddings=40960,
                           rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True),
        # head_dim 32 != 64 / 4, as in Qwen3-0.6B (1024 / 16 = 64 != 128); tied like Qwen3-0.6B.
        "tiny": dict(hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=32, num_hidden_layers=2, vocab_size=512, max_position_embeddings=512,
                     rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=True),
    },
))
