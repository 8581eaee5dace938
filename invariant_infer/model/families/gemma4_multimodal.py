"""Gemma 4's released checkpoints (model type ``gemma4``: ``Gemma4ForConditionalGeneration``), text only.

The wrapper holds a ``Gemma4Model`` (``language_model``: the ``gemma4_text`` decoder, and vision and
audio towers) and the lm_head. Its text side is the ``gemma4_text`` adapter's: the same classes, norms,
MLP and decoder-layer forward. Two forwards are replaced (``model.gemma4_multimodal``): the multimodal
model's, which runs the language model on the text alone (the 2-D padding mask, not transformers' mask
mapping), and the wrapper's, the invariant lm_head then softcapped logits. The towers are never run
and stay unpatched (``FamilyAdapter.unpatched_modules``): images, videos and audio are refused by name
(the support table's ``gemma4_images_audio``) before any compute, so the model is no vision-language
model on any surface."""
from transformers import Gemma4Config
from transformers.models.gemma4.modeling_gemma4 import Gemma4ForConditionalGeneration, Gemma4Model

from ..gemma4_multimodal import conditional_generation_forward, multimodal_model_forward
from . import FamilyAdapter, register_family
from .gemma4 import ADAPTER as TEXT_ADAPTER


def _refuse(config) -> str | None:
    return TEXT_ADAPTER.refuse_config(config.text_config)


# Small towers: a tiny checkpoint holds them as a released one does, and nothing runs them.
_TINY_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                    num_key_value_heads=2, head_dim=16, position_embedding_size=64)
_TINY_AUDIO = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, output_proj_dims=32)

ADAPTER = register_family(FamilyAdapter(
    model_type="gemma4", config_class=Gemma4Config, rms_norm=TEXT_ADAPTER.rms_norm, mlp=TEXT_ADAPTER.mlp,
    head_norms=TEXT_ADAPTER.head_norms, optional_projections=TEXT_ADAPTER.optional_projections,
    norms_scaled_in_fp32=True, mlp_activation="gelu_tanh", refuse_config=_refuse, final_logit_softcapping=True,
    module_forwards={**TEXT_ADAPTER.module_forwards, Gemma4Model: multimodal_model_forward,
                     Gemma4ForConditionalGeneration: conditional_generation_forward},
    unpatched_modules=("vision_tower", "audio_tower", "embed_vision", "embed_audio"),
    check_layer=TEXT_ADAPTER.check_layer,
    presets={
        "tiny": dict(text_config=TEXT_ADAPTER.presets["tiny"], vision_config=_TINY_VISION, audio_config=_TINY_AUDIO),
    },
))
