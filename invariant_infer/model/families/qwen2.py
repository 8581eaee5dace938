"""Qwen2 / Qwen2.5: q/k/v with bias, untied (7B+) or tied (0.5B-3B) embeddings."""
from transformers import Qwen2Config
from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP, Qwen2RMSNorm

from . import FamilyAdapter, register_family

_SMALL = dict(max_position_embeddings=512, rope_theta=10000.0, rms_norm_eps=1e-6, use_sliding_window=False)

ADAPTER = register_family(FamilyAdapter(
    model_type="qwen2", config_class=Qwen2Config, rms_norm=Qwen2RMSNorm, mlp=Qwen2MLP,
    presets={
        # Qwen2.5-1.5B(-Instruct): the widths users run.
        "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_attention_heads=12,
                             num_key_value_heads=2, num_hidden_layers=28, vocab_size=151936,
                             max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                             tie_word_embeddings=True, use_sliding_window=False),
        # Qwen2.5's proportions (MLP ~5.8x, 6 query heads per KV head, head_dim 64) at a size the
        # interpreter runs in seconds.
        "demo": dict(hidden_size=384, intermediate_size=2240, num_attention_heads=6, num_key_value_heads=1,
                     num_hidden_layers=2, vocab_size=4096, max_position_embeddings=4096, rope_theta=1000000.0,
                     rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False),
        "tiny": dict(hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2,
                     num_hidden_layers=2, vocab_size=512, tie_word_embeddings=False, **_SMALL),
    },
))
