"""Requests with images, for a vision-language model (Qwen2.5-VL, Qwen3-VL) in the engine.

A request comes in vLLM's form, ``{"prompt_token_ids": ids, "multi_modal_data": {"image": [...]}}``,
the images as HxWx3 uint8 arrays or PIL images, the prompt holding one image token per image (or
each image's tokens already expanded). At admission, ``ImageInputs.prepare`` runs the processor's
image processor on each image alone, expands the placeholders, encodes the request's images with
the vision tower (each image's features are those of the image alone, whatever else runs) and
computes the prompt's multimodal rope positions from the request's own tokens. The model runner
then builds each step's embeddings from the token ids with the image rows replaced by these
features, so an image's tokens may fall in any prefill chunks. Prefix caching keys each page by
the digests of the images whose tokens it or an earlier page holds (``MultimodalPrompt.page_key``),
so the same token ids with another image never hit.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from ..errors import RequestError
from ..model.image_inputs import prepare_prompt_images


@dataclass(eq=False)
class MultimodalPrompt:
    """What a request's images add to its prompt (see the module's docstring)."""
    image_positions: list[int]         # prompt positions of the image tokens, ascending
    features: torch.Tensor             # [len(image_positions), hidden] on the model's device
    deepstack: list[torch.Tensor]      # Qwen3-VL: per deepstack layer, [len(image_positions), hidden]; else empty
    positions: torch.Tensor            # long [3, prompt length]: the prompt's (temporal, height, width) positions
    rope_delta: int                    # a generated token at index p sits at position p + rope_delta (all three)
    image_spans: list[tuple[int, int, bytes]]  # (first token, end, digest of the processed pixels) per image

    def positions_of(self, start: int, end: int) -> torch.Tensor:
        """long [3, end - start]: the positions of tokens start .. end - 1 (prompt or generated)."""
        prompt = self.positions.shape[1]
        generated = torch.arange(max(start, prompt), max(end, prompt)) + self.rope_delta
        return torch.cat([self.positions[:, start:min(end, prompt)], generated[None].expand(3, -1)], dim=1)

    def image_rows(self, start: int, end: int) -> tuple[int, int]:
        """(first feature row, end) of the image tokens among positions start .. end - 1, which are consecutive
        feature rows (a prefill chunk cuts them anywhere)."""
        return bisect.bisect_left(self.image_positions, start), bisect.bisect_left(self.image_positions, end)

    def page_key(self, first: int, end: int) -> bytes:
        """The digests of the images with tokens in positions first .. end - 1 (a page), in order."""
        return b"".join(digest for start, stop, digest in self.image_spans if start < end and stop > first)


class ImageInputs:
    """Turns a request's images into a ``MultimodalPrompt`` with the model's own image processor and tower."""

    def __init__(self, model, processor):
        self.model, self.image_processor = model, getattr(processor, "image_processor", None)
        self.multimodal = model.model
        self.image_token = model.config.image_token_id

    def prepare(self, token_ids: list[int], images) -> tuple[list[int], MultimodalPrompt]:
        """(the prompt with each image's tokens expanded, its MultimodalPrompt)."""
        if self.image_processor is None:
            raise RequestError("requests with images need the model's processor: Engine(model, processor)",
                               param="multi_modal_data")
        prompt = prepare_prompt_images(self.image_processor, self.model.config, token_ids, images)
        ids = torch.tensor([prompt.token_ids])
        is_image = ids == self.image_token
        device = self.model.get_output_embeddings().weight.device
        grids = prompt.image_grid_thw.to(device)
        with torch.inference_mode():
            encoded = self.multimodal.get_image_features(prompt.pixel_values.to(device), grids)
            positions, delta = self.multimodal.get_rope_index(ids.to(device), is_image.to(device, torch.int32), grids)
        features = torch.cat(list(encoded.pooler_output))
        deepstack = [torch.cat(list(f)) if isinstance(f, (list, tuple)) else f
                     for f in (getattr(encoded, "deepstack_features", None) or [])]
        image_positions = is_image[0].nonzero().flatten().tolist()
        spans, first = [], 0
        for count, digest in zip(prompt.counts, prompt.digests):
            start = image_positions[first]
            spans.append((start, start + count, digest))
            first += count
        return prompt.token_ids, MultimodalPrompt(image_positions, features, deepstack, positions[:, 0].cpu(),
                                                  int(delta.flatten()[0]), spans)
