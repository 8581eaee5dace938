"""Mistral, with or without a sliding window (v0.1 configs set ``sliding_window: 4096``, v0.2+
``null``): every layer attends to the last ``sliding_window`` keys when it is set."""
from transformers import MistralConfig
from transformers.models.mistral.modeling_mistral import MistralMLP, MistralRMSNorm

from . import FamilyAdapter, register_family


ADAPTER = register_family(FamilyAdapter(
    model_type="mistral", window_on_every_layer=True, config_class=MistralConfig, rms_norm=MistralRMSNorm, mlp=MistralMLP,
    presets={
        "mistral-7b-v0.3": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                                num_key_value_heads=8, num_hidden_layers=32, vocab_size=32768,
                                max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-5,
                                tie_word_embeddings=False, sliding_window=None),
        # Mistral-7B-v0.1's config.json: every layer sees the last 4096 keys.
        "mistral-7b-v0.1": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                                num_key_value_heads=8, num_hidden_layers=32, vocab_size=32000,
                                max_position_embeddings=32768, rope_theta=10000.0, rms_norm_eps=1e-5,
                                tie_word_embeddings=False, sliding_window=4096),
        "tiny": dict(hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=1,
                     num_hidden_layers=2, vocab_size=512, max_position_embeddings=512, rope_theta=10000.0,
                     rms_norm_eps=1e-5, tie_word_embeddings=False, sliding_window=None),
    },
))
