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
import hashlib
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import RequestError, UnsupportedModelError


def check_vision_language(config, kernels: str, speculative, max_loras: int, executor) -> None:
    """Refuse, by name, what the engine does not run with a vision-language model (any other: nothing)."""
    if getattr(config, "vision_config", None) is None:
        return
    refused = [what for what, asked in (
        ("kernels='stock'", kernels != "invariant"), ("speculative decoding", speculative),
        ("LoRA adapters", max_loras), ("tensor parallelism", executor.tensor_parallel_size > 1)) if asked]
    if refused:
        raise UnsupportedModelError(f"{config.model_type}: the engine does not run vision-language models with "
                                    f"{'; '.join(refused)} yet")


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

    def expanded_position(self, token_ids: list[int], index: int) -> int:
        """Where position ``index`` of the unexpanded prompt ``token_ids`` (one image token per image, or each
        image's tokens) lies in the expanded one. An index inside an image's tokens is refused."""
        shift = 0
        for k, (start, end, _) in enumerate(self.image_spans):
            first = start - shift  # the image's first token in token_ids
            run = 1
            while first + run < len(token_ids) and token_ids[first + run] == token_ids[first]:
                run += 1
            if index <= first:
                return index + shift
            if index < first + run:
                raise RequestError(f"the prompt length {index} falls inside image {k}'s tokens",
                                   param="prompt_lengths")
            shift += (end - start) - run
        return index + shift

    def page_key(self, first: int, end: int) -> bytes:
        """The digests of the images with tokens in positions first .. end - 1 (a page), in order."""
        return b"".join(digest for start, stop, digest in self.image_spans if start < end and stop > first)


class ImageInputs:
    """Turns a request's images into a ``MultimodalPrompt`` with the model's own image processor and tower."""

    def __init__(self, model, processor):
        self.model, self.image_processor = model, getattr(processor, "image_processor", None)
        self.multimodal = model.model
        self.image_token = model.config.image_token_id
        self.merge = model.config.vision_config.spatial_merge_size

    def prepare(self, token_ids: list[int], images) -> tuple[list[int], MultimodalPrompt]:
        """(the prompt with each image's tokens expanded, its MultimodalPrompt)."""
        if self.image_processor is None:
            raise RequestError("requests with images need the model's processor: Engine(model, processor)",
                               param="multi_modal_data")
        processed = [self._process(image, i) for i, image in enumerate(images)]
        counts = [int(grid.prod()) // self.merge ** 2 for _, grid in processed]
        token_ids = self._expand(token_ids, counts)
        ids = torch.tensor([token_ids])
        is_image = ids == self.image_token
        device = self.model.get_output_embeddings().weight.device
        pixels = torch.cat([p for p, _ in processed]).to(device)
        grids = torch.cat([g for _, g in processed]).to(device)
        with torch.inference_mode():
            encoded = self.multimodal.get_image_features(pixels, grids)
            positions, delta = self.multimodal.get_rope_index(ids.to(device), is_image.to(device, torch.int32), grids)
        features = torch.cat(list(encoded.pooler_output))
        deepstack = [torch.cat(list(f)) if isinstance(f, (list, tuple)) else f
                     for f in (getattr(encoded, "deepstack_features", None) or [])]
        image_positions = is_image[0].nonzero().flatten().tolist()
        spans, first = [], 0
        for (pixel_values, grid), count in zip(processed, counts):
            start = image_positions[first]
            digest = hashlib.sha256(grid.numpy().astype("<i8").tobytes() + pixel_values.numpy().tobytes()).digest()
            spans.append((start, start + count, digest))
            first += count
        return token_ids, MultimodalPrompt(image_positions, features, deepstack, positions[:, 0].cpu(),
                                           int(delta.flatten()[0]), spans)

    def _process(self, image, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(pixel_values [patches, C*T*P*P], image_grid_thw [1, 3]) of one image, processed alone."""
        if isinstance(image, np.ndarray) and (image.ndim != 3 or image.shape[-1] != 3 or image.dtype != np.uint8):
            raise RequestError(f"image {index}: an array image must be HxWx3 uint8, got {image.dtype} "
                               f"{image.shape}", param="multi_modal_data")
        try:
            out = self.image_processor(images=[image], return_tensors="pt")
        except Exception as exc:  # noqa: BLE001  (a request's bad image fails that request)
            raise RequestError(f"image {index}: {type(exc).__name__}: {exc}", param="multi_modal_data") from None
        return out["pixel_values"], out["image_grid_thw"]

    def _expand(self, token_ids: list[int], counts: list[int]) -> list[int]:
        """Each run of image tokens is one image's: one token becomes its count, its count stays."""
        runs, i = [], 0
        while i < len(token_ids):
            if token_ids[i] == self.image_token:
                j = i
                while j < len(token_ids) and token_ids[j] == self.image_token:
                    j += 1
                runs.append((i, j))
                i = j
            else:
                i += 1
        if len(runs) != len(counts):
            raise RequestError(f"the prompt has {len(runs)} runs of image tokens ({self.image_token}) for "
                               f"{len(counts)} images", param="multi_modal_data")
        out, previous = [], 0
        for (start, end), count in zip(runs, counts):
            if end - start not in (1, count):
                raise RequestError(f"an image of {count} tokens has a run of {end - start} image tokens in the prompt "
                                   "(one, or all of its tokens)", param="multi_modal_data")
            out += token_ids[previous:start] + [self.image_token] * count
            previous = end
        return out + token_ids[previous:]
