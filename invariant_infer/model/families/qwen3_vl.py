"""Qwen3-VL (``AutoModelForImageTextToText``): the Qwen3 language model (per-head q/k RMSNorms) with
interleaved multimodal RoPE and deepstack (image features from early vision blocks added to the
first decoder layers' outputs at the image positions), and a vision tower (Conv3d patches with
bias, a learned position grid sampled bilinearly, LayerNorm blocks with 2-D rotary and a gelu_tanh
MLP, attention over each image, the merger and the deepstack mergers) on the invariant kernels
(``invariant_infer.model.vision``). Videos are refused by name."""
from torch import nn
from transformers import Qwen3VLConfig
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextMLP, Qwen3VLTextRMSNorm, Qwen3VLVisionModel

from ..vision import qwen3_vl_vision_forward, set_vision_rope_tables
from . import FamilyAdapter, VisionLayout, register_family


def _refuse_config(config) -> str | None:
    vision = config.vision_config
    if vision.hidden_act != "gelu_pytorch_tanh":
        return f"vision_config.hidden_act={vision.hidden_act!r}: only the gelu_pytorch_tanh vision MLP is supported"
    return None


def _refuse_tower(tower: nn.Module) -> str | None:
    embed = tower.patch_embed.proj
    if type(embed) is not nn.Conv3d or tuple(embed.stride) != tuple(embed.kernel_size):
        return "visual.patch_embed.proj must be the Conv3d whose stride is its kernel"
    for name, merger in [("merger", tower.merger)] + [(f"deepstack_merger_list.{i}", m)
                                                      for i, m in enumerate(tower.deepstack_merger_list)]:
        if type(merger.act_fn) is not nn.GELU or merger.act_fn.approximate != "none":
            return f"visual.{name}.act_fn is {merger.act_fn!r}, not the exact nn.GELU()"
    norms = [m for m in tower.modules() if isinstance(m, nn.LayerNorm)]
    if any(m.weight is None or m.bias is None or len(m.normalized_shape) != 1 for m in norms):
        return "the vision tower's LayerNorms must have a weight and a bias over the last dim"
    if tower.interpolation_mode != "bilinear" or not tower.interpolation_align_corners:
        return "only the bilinear position grid with aligned corners is supported"
    return None


ADAPTER = register_family(FamilyAdapter(
    model_type="qwen3_vl", config_class=Qwen3VLConfig, rms_norm=Qwen3VLTextRMSNorm, mlp=Qwen3VLTextMLP,
    head_norms=("q_norm", "k_norm"), refuse_config=_refuse_config, mrope="interleaved",
    vision=VisionLayout(tower=Qwen3VLVisionModel, forward=qwen3_vl_vision_forward, prepare=set_vision_rope_tables,
                        refuse_tower=_refuse_tower),
    presets={
        # Qwen3-VL-2B-Instruct's widths.
        "qwen3-vl-2b": dict(
            text_config=dict(hidden_size=2048, intermediate_size=6144, num_attention_heads=16, num_key_value_heads=8,
                             head_dim=128, num_hidden_layers=28, vocab_size=151936, max_position_embeddings=262144,
                             rms_norm_eps=1e-6, tie_word_embeddings=True,
                             rope_parameters={"rope_type": "default", "rope_theta": 5000000.0,
                                              "mrope_section": [24, 20, 20], "mrope_interleaved": True}),
            vision_config=dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, out_hidden_size=2048,
                               patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304,
                               deepstack_visual_indexes=[5, 11, 17], hidden_act="gelu_pytorch_tanh"),
            image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, tie_word_embeddings=True),
        # Head dim 16 (interleaved sections 2 + 3 + 3 of its 8 frequencies), a 4 x 4 position grid sampled
        # for larger images, deepstack from the first of two vision blocks. Init std 0.1, as qwen2_5_vl's.
        "tiny": dict(
            text_config=dict(hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=16, num_hidden_layers=2, vocab_size=512, max_position_embeddings=1024,
                             rms_norm_eps=1e-6, tie_word_embeddings=False, initializer_range=0.1, bos_token_id=1,
                             eos_token_id=2,
                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                              "mrope_section": [2, 3, 3], "mrope_interleaved": True}),
            vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                               patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16,
                               deepstack_visual_indexes=[0], hidden_act="gelu_pytorch_tanh", initializer_range=0.1),
            image_token_id=500, video_token_id=501, vision_start_token_id=502, vision_end_token_id=503,
            tie_word_embeddings=False, initializer_range=0.1),
    },
))
