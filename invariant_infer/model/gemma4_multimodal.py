"""The forwards ``make_invariant`` replaces on Gemma 4's multimodal checkpoints (model type ``gemma4``;
the family: ``families.gemma4_multimodal``), text only.

* ``Gemma4Model``: images, videos and audio are refused by name before any compute (and token types
  that mark any: ``mm_token_type_ids`` not all 0, which transformers reads for the bidirectional
  attention of ``use_bidirectional_attention="vision"``, so text alone attends causally); the language model
  runs on the text as ``Gemma4ForCausalLM``'s decoder does, with the 2-D padding mask the invariant
  attention turns into per-row bounds (transformers' own forward builds a mask mapping first).
  Placeholder tokens (image, video, audio) become the pad token for the per-layer inputs, as
  transformers does; given ``inputs_embeds`` alone, the per-layer inputs come from the ids
  ``token_ids_of_embeddings`` finds.
* ``Gemma4ForConditionalGeneration``: that model, the invariant lm_head on the kept rows, then
  ``softcap_logits`` (each element alone) by the text config's ``final_logit_softcapping``.
"""
from __future__ import annotations

import dataclasses

import torch
from transformers.models.gemma4.modeling_gemma4 import Gemma4CausalLMOutputWithPast, Gemma4ModelOutputWithPast

from .gemma4 import token_ids_of_embeddings
from .logits import softcap_logits
from .support import require

# Inputs of the towers, refused by name: the model runs its text only.
MEDIA_ARGUMENTS = ("pixel_values", "pixel_values_videos", "input_features", "input_features_mask",
                   "image_position_ids", "video_position_ids", "num_frames_per_video", "mm_encoder_outputs")
_PLACEHOLDERS = ("image_token_id", "video_token_id", "audio_token_id")


def refuse_media(arguments: dict) -> None:
    for name in MEDIA_ARGUMENTS:
        if arguments.get(name) is not None:
            require("gemma4_images_audio", "model", name)


def _text_ids(config, ids: torch.Tensor) -> torch.Tensor:
    """``ids`` with every image, video and audio placeholder replaced by the pad token (elementwise)."""
    placeholders = [getattr(config, name, None) for name in _PLACEHOLDERS]
    placeholders = torch.tensor([p for p in placeholders if p is not None], dtype=ids.dtype, device=ids.device)
    return torch.where(torch.isin(ids, placeholders), config.text_config.pad_token_id, ids)


def _carried(output_class, outputs) -> dict:
    names = {f.name for f in dataclasses.fields(output_class)}
    return {name: value for name, value in outputs.items() if name in names}


def multimodal_model_forward(self, input_ids=None, pixel_values=None, pixel_values_videos=None, input_features=None,
                             attention_mask=None, input_features_mask=None, position_ids=None, **kwargs):
    """``Gemma4Model.forward`` on text alone."""
    refuse_media({"pixel_values": pixel_values, "pixel_values_videos": pixel_values_videos,
                  "input_features": input_features, "input_features_mask": input_features_mask, **kwargs})
    types = kwargs.pop("mm_token_type_ids", None)
    if types is not None and not torch.compiler.is_compiling() and bool((types != 0).any()):
        # transformers would attend bidirectionally within such blocks (use_bidirectional_attention "vision")
        require("gemma4_images_audio", "model", "mm_token_type_ids (image, video or audio tokens)")
    for name in MEDIA_ARGUMENTS:
        kwargs.pop(name, None)
    return_dict = kwargs.pop("return_dict", None)
    text = self.language_model
    embeds = kwargs.get("inputs_embeds")
    if input_ids is not None:
        input_ids = _text_ids(self.config, input_ids)
    elif embeds is not None and text.hidden_size_per_layer_input and kwargs.get("per_layer_inputs") is None:
        ids = _text_ids(self.config, token_ids_of_embeddings(text.embed_tokens, embeds))
        kwargs["per_layer_inputs"] = text.get_per_layer_inputs(ids, None)
    outputs = text(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, return_dict=True,
                   **kwargs)
    result = Gemma4ModelOutputWithPast(**_carried(Gemma4ModelOutputWithPast, outputs))
    return result.to_tuple() if return_dict is False else result


def conditional_generation_forward(self, input_ids=None, pixel_values=None, pixel_values_videos=None,
                                   input_features=None, attention_mask=None, input_features_mask=None,
                                   position_ids=None, *, labels=None, logits_to_keep=0, return_dict=None, **kwargs):
    """``Gemma4ForConditionalGeneration.forward`` on text alone: softcapped logits of the invariant lm_head."""
    refuse_media({"pixel_values": pixel_values, "pixel_values_videos": pixel_values_videos,
                  "input_features": input_features, "input_features_mask": input_features_mask, **kwargs})
    outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         return_dict=True, **kwargs)
    hidden = outputs.last_hidden_state
    kept = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
    logits = self.lm_head(hidden[:, kept, :])
    text_config = self.config.get_text_config()
    if text_config.final_logit_softcapping is not None:
        logits = softcap_logits(logits, text_config.final_logit_softcapping)
    loss = None
    if labels is not None:
        loss = self.loss_function(logits, labels, text_config.vocab_size, **kwargs)
    carried = {name: value for name, value in _carried(Gemma4CausalLMOutputWithPast, outputs).items()
               if name not in ("last_hidden_state", "logits", "loss")}
    result = Gemma4CausalLMOutputWithPast(loss=loss, logits=logits, **carried)
    return result.to_tuple() if return_dict is False else result
