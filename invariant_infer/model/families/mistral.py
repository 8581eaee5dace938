"""Mistral without a sliding window (v0.2+ configs set ``sliding_window: null``)."""
from transformers import MistralConfig
from transformers.models.mistral.modeling_mistral import MistralMLP, MistralRMSNorm

from . import FamilyAdapter, register_family, sliding_window_refusal


def _refuse(config) -> str | None:
    if getattr(config, "sliding_window", None) is not None:
        return (f"sliding_window={config.sliding_window}: sliding-window attention is not supported; models "
                "trained without one (Mistral-7B-v0.2/v0.3) set sliding_window to null")
    return sliding_window_refusal(config)


ADAPTER = register_family(FamilyAdapter(
    model_type="mistral", config_class=MistralConfig, rms_norm=MistralRMSNorm, mlp=MistralMLP,
    refuse_config=_refuse,
    refused="a configured `sliding_window` (MistralConfig's default is 4096: set it to null)",
    presets={
        "mistral-7b-v0.3": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                                num_key_value_heads=8, num_hidden_layers=32, vocab_size=32768,
                                max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-5,
                                tie_word_embeddings=False, sliding_window=None),
        "tiny": dict(hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=1,
                     num_hidden_layers=2, vocab_size=512, max_position_embeddings=512, rope_theta=10000.0,
                     rms_norm_eps=1e-5, tie_word_embeddings=False, sliding_window=None),
    },
))
