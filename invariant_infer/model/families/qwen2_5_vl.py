"""Qwen2.5-VL (``AutoModelForImageTextToText``): the Qwen2 language model (q/k/v with bias) with
multimodal RoPE in sections, and a vision tower (Conv3d patches, RMSNorm blocks with 2-D rotary,
window attention beside full attention per image, a silu MLP with bias, the patch merger) on the
invariant kernels (``invariant_infer.model.vision``). Videos are refused by name."""
from torch import nn
from transformers import Qwen2_5_VLConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (Qwen2_5_VisionTransformerPretrainedModel,
                                                                Qwen2_5_VLRMSNorm, Qwen2MLP)

from ..vision import qwen2_5_vision_forward, set_vision_rope_tables
from . import FamilyAdapter, VisionLayout, register_family


def _refuse_config(config) -> str | None:
    vision = config.vision_config
    if vision.hidden_act != "silu":
        return f"vision_config.hidden_act={vision.hidden_act!r}: only the silu vision MLP is supported"
    return None


def _refuse_tower(tower: nn.Module) -> str | None:
    embed = tower.patch_embed.proj
    if type(embed) is not nn.Conv3d or embed.bias is not None or tuple(embed.stride) != tuple(embed.kernel_size):
        return "visual.patch_embed.proj must be the Conv3d without bias whose stride is its kernel"
    gelu = tower.merger.mlp[1]
    if type(gelu) is not nn.GELU or gelu.approximate != "none":
        return f"visual.merger.mlp[1] is {gelu!r}, not the exact nn.GELU()"
    return None


_TINY_VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14,
                    spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1],
                    hidden_act="silu", in_channels=3)

ADAPTER = register_family(FamilyAdapter(
    model_type="qwen2_5_vl", config_class=Qwen2_5_VLConfig, rms_norm=Qwen2_5_VLRMSNorm, mlp=Qwen2MLP,
    refuse_config=_refuse_config, mrope="sectioned",
    vision=VisionLayout(tower=Qwen2_5_VisionTransformerPretrainedModel, forward=qwen2_5_vision_forward,
                        prepare=set_vision_rope_tables, refuse_tower=_refuse_tower),
    presets={
        # Qwen2.5-VL-3B-Instruct's widths.
        "qwen2.5-vl-3b": dict(
            text_config=dict(hidden_size=2048, intermediate_size=11008, num_attention_heads=16, num_key_value_heads=2,
                             num_hidden_layers=36, vocab_size=151936, max_position_embeddings=128000,
                             rms_norm_eps=1e-6, tie_word_embeddings=True,
                             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                              "mrope_section": [16, 24, 24]}),
            vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048,
                               patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                               fullatt_block_indexes=[7, 15, 23, 31], hidden_act="silu"),
            image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, tie_word_embeddings=True),
        # Head dim 16 (mrope sections 2 + 3 + 3 of its 8 frequencies), two vision blocks: one over windows
        # of 2 x 2 merged units (8 x 8 patches), one over whole images. Init std 0.1: at 0.02 a tiny
        # model repeats one token.
        "tiny": dict(
            text_config=dict(hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2,
                             num_hidden_layers=2, vocab_size=512, max_position_embeddings=1024, rms_norm_eps=1e-6,
                             tie_word_embeddings=False, initializer_range=0.1, bos_token_id=1, eos_token_id=2,
                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                              "mrope_section": [2, 3, 3]}),
            vision_config={**_TINY_VISION, "initializer_range": 0.1},
            image_token_id=500, video_token_id=501, vision_start_token_id=502, vision_end_token_id=503,
            tie_word_embeddings=False, initializer_range=0.1),
    },
))
