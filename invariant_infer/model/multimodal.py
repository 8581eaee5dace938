"""The pre-forward hook on a vision-language model's multimodal model (``model.model``: the vision
tower and the language model). transformers computes the multimodal rope positions there, per row
from the row's own tokens (``get_rope_index``), and keeps ``rope_deltas`` between calls for decoding.
The hook closes the two ways that state or a missing input would change a row's numbers:
  * a fresh forward (no cache) from ``inputs_embeds`` without ``position_ids`` would reuse the
    deltas of whatever call came before: they are cleared, so such rows get text positions, as they
    would alone (rows with images take the ``position_ids`` of ``get_rope_index``);
  * ``input_ids`` with images but without ``mm_token_type_ids`` would give image tokens text positions:
    the types are derived from the image token id.
Videos are refused by name."""
from __future__ import annotations

import torch

from ..errors import NonInvariantInputError
from .padding import cache_length
from .support import require


def multimodal_pre_hook(module, args, kwargs):
    if args:  # bind positional arguments (input_ids, attention_mask, position_ids ...) by name
        names = ("input_ids", "attention_mask", "position_ids")
        kwargs = {**dict(zip(names, args)), **kwargs}
        if len(args) > len(names):
            raise NonInvariantInputError("pass the multimodal model's arguments past position_ids by keyword")
    for name in ("pixel_values_videos", "video_grid_thw"):
        if kwargs.get(name) is not None:
            require("videos", "model", name)
    input_ids = kwargs.get("input_ids")
    if kwargs.get("position_ids") is None and cache_length(kwargs) == 0 and input_ids is None:
        module.rope_deltas = None
    if input_ids is not None and kwargs.get("image_grid_thw") is not None and kwargs.get("mm_token_type_ids") is None:
        kwargs["mm_token_type_ids"] = (input_ids == module.config.image_token_id).to(torch.int32)
    return (), kwargs
