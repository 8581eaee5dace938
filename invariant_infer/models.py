"""Random-init Qwen2 checkpoints: Qwen2.5's real shapes, and small ones that run on CPU."""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

# Qwen2.5-1.5B(-Instruct): the widths users run.
QWEN25_1_5B = dict(hidden_size=1536, intermediate_size=8960, num_attention_heads=12, num_key_value_heads=2,
                   num_hidden_layers=28, vocab_size=151936, max_position_embeddings=32768, rope_theta=1000000.0,
                   rms_norm_eps=1e-6, tie_word_embeddings=True)

PRESETS = {
    "qwen2.5-1.5b": QWEN25_1_5B,
    # Qwen2.5's proportions (MLP ~5.8x, 6 query heads per KV head, head_dim 64) at a size the
    # interpreter runs in seconds.
    "demo": dict(hidden_size=384, intermediate_size=2240, num_attention_heads=6, num_key_value_heads=1,
                 num_hidden_layers=2, vocab_size=4096, max_position_embeddings=4096, rope_theta=1000000.0,
                 rms_norm_eps=1e-6, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2,
                 num_hidden_layers=2, vocab_size=512, max_position_embeddings=512, rope_theta=10000.0,
                 rms_norm_eps=1e-6, tie_word_embeddings=False),
}


def qwen2_config(preset: str = "tiny", **overrides) -> Qwen2Config:
    """A Qwen2Config from a preset name, with any field overridden (e.g. num_hidden_layers=1)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    fields = {**PRESETS[preset], **overrides}
    fields.setdefault("use_sliding_window", False)
    return Qwen2Config(**fields)


def random_qwen2(config: Qwen2Config, seed: int = 0, dtype: torch.dtype = torch.float32) -> Qwen2ForCausalLM:
    """A randomly initialised Qwen2ForCausalLM, in eval mode."""
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(dtype).eval()
    # HF initialises biases to zero; random ones make the q/k/v bias path visible in tests.
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0.0, 0.02)
    return model


def save_random_checkpoint(path: str | Path, config: Qwen2Config, seed: int = 0,
                           dtype: torch.dtype = torch.float32) -> Path:
    """Write a random checkpoint with ``save_pretrained`` so tests load it as users load real ones."""
    path = Path(path)
    random_qwen2(config, seed, dtype).save_pretrained(path)
    return path
