"""Llama 3.x: ``rope_type: "llama3"`` frequency scaling, optional attention and MLP biases, tied
(3.2 1B/3B) or untied (3.1 8B) embeddings."""
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

from . import FamilyAdapter, register_family


def _llama3_rope(factor: float, original_max_positions: int, theta: float = 500000.0) -> dict:
    return dict(rope_type="llama3", rope_theta=theta, factor=factor, low_freq_factor=1.0, high_freq_factor=4.0,
                original_max_position_embeddings=original_max_positions)


def _refuse(config) -> str | None:
    if (getattr(config, "pretraining_tp", 1) or 1) > 1:
        return "pretraining_tp > 1 splits the projections into slices summed in another order; set it to 1"
    return None


ADAPTER = register_family(FamilyAdapter(
    model_type="llama", config_class=LlamaConfig, rms_norm=LlamaRMSNorm, mlp=LlamaMLP,
    refuse_config=_refuse,
    presets={
        "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                             num_hidden_layers=32, vocab_size=128256, max_position_embeddings=131072,
                             rms_norm_eps=1e-5, tie_word_embeddings=False, rope_parameters=_llama3_rope(8.0, 8192)),
        "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8,
                             head_dim=64, num_hidden_layers=16, vocab_size=128256, max_position_embeddings=131072,
                             rms_norm_eps=1e-5, tie_word_embeddings=True, rope_parameters=_llama3_rope(32.0, 8192)),
        # llama3 scaling over a short original context, so that it changes most of the tiny model's
        # frequencies; both bias flags on, so that those paths run too.
        "tiny": dict(hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2,
                     num_hidden_layers=2, vocab_size=512, max_position_embeddings=512, rms_norm_eps=1e-5,
                     tie_word_embeddings=True, attention_bias=True, mlp_bias=True,
                     rope_parameters=_llama3_rope(8.0, 64)),
    },
))
