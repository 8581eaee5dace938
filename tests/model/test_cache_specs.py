"""Each decoder layer's cache spec (``invariant_infer.model.cache_specs``) for every family's tiny
preset and for real presets (Gemma 3's five sliding layers to one global, gpt-oss's alternation,
Mistral with and without a window, Qwen3.5 / Qwen3-Next's Gated DeltaNet layers, the vision-language
models' language models), the bytes each spec gives against hand-computed numbers, and the model
layer's one answer to "which layers are linear attention" and "is this vision-language" agreeing
with the loaded modules of every family."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, Qwen3NextConfig

from invariant_infer import make_invariant
from invariant_infer.errors import UnsupportedModelError
from invariant_infer.model.cache_specs import (FullAttentionSpec, LatentAttentionSpec, LinearStateSpec, SharedKVSpec,
                                               SlidingWindowSpec, attention_layers, cache_specs, is_hybrid,
                                               linear_attention_layers)
from invariant_infer.model.checks import base_model
from invariant_infer.model.families import FAMILIES, is_vision_language
from invariant_infer.model.kinds import config_kinds
from invariant_infer.testing.random_checkpoints import random_config, random_model

FULL, WINDOW24 = FullAttentionSpec, lambda heads, dim: SlidingWindowSpec(heads, dim, window=24)
# The tiny presets' linear layers: 2 key heads of 16, 4 value heads of 32, a convolution of 4:
# conv_dim = 2 * 2 * 16 + 4 * 32.
TINY_LINEAR = LinearStateSpec(conv_dim=2 * 2 * 16 + 4 * 32, conv_kernel=4, num_v_heads=4, head_k_dim=16, head_v_dim=32)
# Per family's tiny preset (2 layers): the specs, from the preset's fields (KV heads, head_dim or
# hidden / heads, layer_types, sliding_window).
TINY_SPECS = {
    "deepseek_v3": (LatentAttentionSpec(1, 32 + 16),) * 2,  # kv_lora_rank + qk_rope_head_dim, one tensor
    "gemma3_text": (WINDOW24(1, 32), FULL(1, 32)),
    # 4 layers: sliding (2 KV heads of 16, 16 keys), global (1 KV head of 32), then two reading theirs
    "gemma4_text": (SlidingWindowSpec(2, 16, window=16), FULL(1, 32), SharedKVSpec(0), SharedKVSpec(1)),
    "gemma4": (SlidingWindowSpec(2, 16, window=16), FULL(1, 32), SharedKVSpec(0), SharedKVSpec(1)),  # its text model
    "gpt_oss": (WINDOW24(2, 32), FULL(2, 32)),
    "glm4_moe": (FULL(2, 32),) * 2,
    "llama": (FULL(2, 16),) * 2,
    "mistral": (FULL(1, 16),) * 2,  # sliding_window None
    "mixtral": (FULL(1, 16),) * 2,
    "qwen2": (FULL(2, 16),) * 2,
    "qwen2_5_vl": (FULL(2, 16),) * 2,  # text_config's
    "qwen2_moe": (FULL(2, 16),) * 2,
    "qwen3": (FULL(2, 32),) * 2,
    "qwen3_moe": (FULL(2, 32),) * 2,
    "qwen3_vl": (FULL(2, 16),) * 2,  # text_config's
    "qwen3_5_text": (TINY_LINEAR, FULL(2, 32)),
    "qwen3_5_moe_text": (TINY_LINEAR, FULL(2, 32)),
    "qwen3_next": (TINY_LINEAR, FULL(2, 32)),
}


def test_every_family_has_its_tiny_specs():
    assert set(TINY_SPECS) == set(FAMILIES)  # a new family adds its row here


@pytest.mark.parametrize("family", sorted(TINY_SPECS))
def test_tiny_preset_specs(family):
    config = random_config(family)
    specs = cache_specs(config)
    assert specs == TINY_SPECS[family]
    linear = [i for i, spec in enumerate(TINY_SPECS[family]) if isinstance(spec, LinearStateSpec)]
    assert linear_attention_layers(config) == linear and is_hybrid(config) == bool(linear)
    assert attention_layers(config) == [i for i, spec in enumerate(TINY_SPECS[family])
                                        if i not in linear and not isinstance(spec, SharedKVSpec)]


def test_real_presets():
    gemma = cache_specs(random_config("gemma3_text", "gemma-3-27b"))
    assert len(gemma) == 62
    assert [i for i, spec in enumerate(gemma) if isinstance(spec, FULL)] == [5, 11, 17, 23, 29, 35, 41, 47, 53, 59]
    assert {spec for spec in gemma if isinstance(spec, SlidingWindowSpec)} == {SlidingWindowSpec(16, 128, window=1024)}
    gemma4 = cache_specs(random_config("gemma4_text", "gemma-4-31b"))  # the global layers' own KV heads and head_dim
    assert gemma4 == ((SlidingWindowSpec(16, 256, window=1024),) * 5 + (FULL(4, 512),)) * 10
    gpt_oss = cache_specs(random_config("gpt_oss", "gpt-oss-20b"))
    assert gpt_oss == (SlidingWindowSpec(8, 64, window=128), FULL(8, 64)) * 12
    assert cache_specs(random_config("mistral", "mistral-7b-v0.1")) == (SlidingWindowSpec(8, 128, window=4096),) * 32
    assert cache_specs(random_config("mistral", "mistral-7b-v0.3")) == (FULL(8, 128),) * 32  # sliding_window None
    assert cache_specs(random_config("mistral", "mistral-7b-v0.3", sliding_window=512)) == \
        (SlidingWindowSpec(8, 128, window=512),) * 32
    assert cache_specs(random_config("llama", "llama-3.1-8b")) == (FULL(8, 128),) * 32
    assert cache_specs(random_config("qwen2_5_vl", "qwen2.5-vl-3b")) == (FULL(2, 128),) * 36  # 2048 / 16 heads
    vl = random_config("qwen3_vl", "qwen3-vl-2b")
    assert cache_specs(vl) == (FULL(vl.text_config.num_key_value_heads, vl.text_config.head_dim),) * \
        vl.text_config.num_hidden_layers
    # Qwen3-Next-80B-A3B (transformers' defaults are its config): every fourth layer full attention.
    qwen3_next = cache_specs(Qwen3NextConfig())
    linear = LinearStateSpec(conv_dim=2 * 16 * 128 + 32 * 128, conv_kernel=4, num_v_heads=32, head_k_dim=128,
                             head_v_dim=128)
    assert qwen3_next == (linear, linear, linear, FULL(2, 256)) * 12
    assert linear_attention_layers(Qwen3NextConfig()) == [i for i in range(48) if i % 4 != 3]


def test_bytes_against_hand_computation():
    sliding, full = cache_specs(random_config("gemma3_text", "gemma-3-27b"))[4:6]
    # K and V, 16 heads of 128, 2 bytes each; a rank of two holds 8 heads.
    assert full.kv_bytes_per_token(torch.bfloat16) == 2 * 16 * 128 * 2 == 8192
    assert full.kv_bytes_per_token(torch.bfloat16, tp_size=2) == 4096
    assert sliding.kv_bytes_per_token(torch.float32) == 2 * 16 * 128 * 4
    assert (sliding.tokens_held(800), sliding.tokens_held(32768), full.tokens_held(32768)) == (800, 1024, 32768)
    linear = cache_specs(Qwen3NextConfig())[0]
    # 63 unfinished rows of conv_dim + 2 Hv in bf16, the convolution's last 3 inputs, the fp32 state.
    assert linear.state_bytes(torch.bfloat16, 63) == 63 * (8192 + 64) * 2 + 3 * 8192 * 2 + 4 * 32 * 128 * 128
    assert linear.state_bytes(torch.bfloat16, 0) == 3 * 8192 * 2 + 4 * 32 * 128 * 128


def test_edited_layer_types_change_the_specs():
    """Negative control: the specs follow layer_types, they are not read off the family."""
    assert cache_specs(random_config("gemma3_text", layer_types=["full_attention", "sliding_attention"])) == \
        (FULL(1, 32), WINDOW24(1, 32))
    assert cache_specs(random_config("gemma3_text", layer_types=["full_attention"] * 2)) == (FULL(1, 32),) * 2
    dense = random_config("qwen3_5_text", layer_types=["full_attention"] * 2)
    assert cache_specs(dense) == (FULL(2, 32),) * 2 and not is_hybrid(dense)
    assert "hybrid" not in config_kinds(dense) and "hybrid" in config_kinds(random_config("qwen3_5_text"))
    assert "windowed" not in config_kinds(random_config("gemma3_text", layer_types=["full_attention"] * 2))
    assert "windowed" in config_kinds(random_config("mistral", sliding_window=24))
    assert "windowed" not in config_kinds(random_config("mistral"))
    # A layer named sliding with no window configured sees every key (transformers' attention gets window None).
    unwindowed = random_config("qwen2", layer_types=["sliding_attention", "full_attention"])
    assert cache_specs(unwindowed) == (FULL(2, 16),) * 2 and "windowed" not in config_kinds(unwindowed)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_one_answer_agrees_with_the_modules(family):
    """The config's answers (linear layers, vision-language) are what the loaded model holds: the adapter's
    structural ``is_linear_attention`` per layer, and a vision tower that runs under a ``vision_config``
    (Gemma 4's towers never run: its images are refused, so it is no vision-language model)."""
    config = random_config(family)
    auto = AutoModelForImageTextToText if is_vision_language(config) else AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(config)
    structural = [i for i, layer in enumerate(base_model(model).layers)
                  if FAMILIES[family].is_linear_attention(layer)]
    assert structural == linear_attention_layers(config)
    towers_run = getattr(config, "vision_config", None) is not None and not FAMILIES[family].unpatched_modules
    assert is_vision_language(config) == towers_run
    assert is_vision_language(config) == (FAMILIES[family].vision is not None)


def test_a_model_whose_layers_disagree_with_its_config_is_refused():
    """Negative control of the agreement: a hybrid model whose config no longer names its Gated DeltaNet
    layer is refused by name, never patched by one answer and cached by the other."""
    model = random_model(random_config("qwen3_5_text"))
    model.config.layer_types = ["full_attention"] * 2
    with pytest.raises(UnsupportedModelError, match=r"layers\.0 holds linear_attn .* an attention layer"):
        make_invariant(model)
    model.config.layer_types = ["linear_attention", "full_attention"]
    make_invariant(model)


def test_is_vision_language_outside_the_families():
    class Other:
        model_type = "gemma3"  # the multimodal Gemma 3 config: its language model is the supported family
        vision_config = object()
    assert not is_vision_language(Other())
