"""A vision-language prompt's images turned into the model's inputs, one image at a time, as the engine,
``score_sequences`` and the score command all take them.

A prompt holds one image token per image (or each image's tokens already expanded). Each image is run
through the checkpoint's image processor alone, so its pixels never depend on the other images of the
call; each run of image tokens is then expanded to its image's token count. ``PromptImages`` keeps
what the forward needs (the expanded ids, the pixel values and grids) and what caching and scoring
need (each image's token count and the digest of its processed pixels). ``ImageInputs`` encodes
them further into the prompt's ``PromptInputs`` (``prompt_inputs.py``), as the engine takes them.
"""
from __future__ import annotations

import base64
import hashlib
import io
import re
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import InvalidArgumentError, RequestError
from .families import is_vision_language
from .prompt_inputs import EmbeddingOverrides, PromptInputs
from .support import require

PARAM = "multi_modal_data"


def _describe(exc: Exception) -> str:
    """The exception's type and message without object addresses: the same input, the same message."""
    return f"{type(exc).__name__}: {re.sub(r' <[^>]*>', '', str(exc))}"


def open_image(source: str):
    """The PIL image of a base64 ``data:`` URL (``data:`` sources) or of a file, its pixels not read yet (its
    size is); raises ``InvalidArgumentError`` (or ``OSError`` for a file that cannot be read)."""
    from PIL import Image
    if not source.startswith("data:"):
        return Image.open(source)
    header, _, payload = source.partition(",")
    if not header.endswith(";base64"):
        raise InvalidArgumentError("the data: URL must be base64 (data:image/...;base64,...)")
    try:
        return Image.open(io.BytesIO(base64.b64decode(payload, validate=True)))
    except Exception as exc:  # noqa: BLE001  (any undecodable payload is the caller's input's fault)
        raise InvalidArgumentError(f"not a decodable image ({_describe(exc)})") from None


def decode_data_url(url: str) -> np.ndarray:
    """A base64 ``data:`` URL's image as HxWx3 uint8; raises ``InvalidArgumentError`` saying what is wrong."""
    if not isinstance(url, str) or not url.startswith("data:"):
        raise InvalidArgumentError("not a data: URL")
    with open_image(url) as image:
        try:
            return np.asarray(image.convert("RGB"), dtype=np.uint8)
        except Exception as exc:  # noqa: BLE001  (a truncated payload fails here)
            raise InvalidArgumentError(f"not a decodable image ({_describe(exc)})") from None


def placeholder_token_ids(config) -> tuple[int, ...]:
    """The tokens a vision-language model's prompt holds in place of its images' and videos' features
    (``image_token_id``, ``video_token_id``); empty for a text model. A completion never holds one: the
    next forward over it would find more placeholders than features (transformers refuses that, as in
    TRL's training step), so the engine and ``generate`` never sample them (as TRL's own sampler
    suppresses the image token)."""
    if not is_vision_language(config):
        return ()
    ids = (getattr(config, "image_token_id", None), getattr(config, "video_token_id", None))
    return tuple(dict.fromkeys(int(t) for t in ids if t is not None))


def image_token_count(image_processor, config, height: int, width: int) -> int | None:
    """The tokens an image of this size becomes, from the processor's own resize rule without processing
    its pixels (None where the processor cannot say)."""
    patches = getattr(image_processor, "get_number_of_image_patches", None)
    return None if patches is None else int(patches(height, width)) // config.vision_config.spatial_merge_size ** 2


def split_multimodal(prompt: dict, surface: str = "engine") -> tuple[object, list | None]:
    """(its ``prompt_token_ids`` or ``prompt`` text, its images or None) of a prompt in vLLM's multimodal form,
    ``{"prompt_token_ids": ids (or "prompt": text), "multi_modal_data": {"image": image or [images]}}``;
    raises ``RequestError``. ``surface``: the support table's surface that reads it ("engine", "scoring")."""
    unknown = set(prompt) - {"prompt_token_ids", "prompt", "multi_modal_data"}
    if unknown or ("prompt_token_ids" in prompt) == ("prompt" in prompt):
        raise RequestError("a multimodal prompt is {'prompt_token_ids': ids or 'prompt': text, "
                           f"'multi_modal_data': {{'image': [...]}}}}; got the keys {sorted(prompt)}")
    data = prompt.get("multi_modal_data") or {}
    if isinstance(data, dict) and "video" in data:
        require("videos", surface, param=PARAM)
    if not isinstance(data, dict) or set(data) - {"image"}:
        raise RequestError(f"multi_modal_data takes images only ('image'; videos are not supported yet), got "
                           f"{sorted(data) if isinstance(data, dict) else type(data).__name__}", param=PARAM)
    images = data.get("image")
    images = None if images is None else list(images) if isinstance(images, (list, tuple)) else [images]
    return prompt.get("prompt_token_ids", prompt.get("prompt")), images or None


def process_image(image_processor, image, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(pixel_values [patches, C*T*P*P], image_grid_thw [1, 3]) of one image, processed alone."""
    if isinstance(image, np.ndarray) and (image.ndim != 3 or image.shape[-1] != 3 or image.dtype != np.uint8):
        raise RequestError(f"image {index}: an array image must be HxWx3 uint8, got {image.dtype} {image.shape}",
                           param=PARAM)
    try:
        out = image_processor(images=[image], return_tensors="pt")
    except Exception as exc:  # noqa: BLE001  (a bad image fails its own prompt)
        raise RequestError(f"image {index}: {_describe(exc)}", param=PARAM) from None
    return out["pixel_values"], out["image_grid_thw"]


def image_token_runs(token_ids: list[int], image_token: int) -> list[tuple[int, int]]:
    """(start, end) of each run of consecutive image tokens: one run per image."""
    runs, i = [], 0
    while i < len(token_ids):
        if token_ids[i] == image_token:
            j = i
            while j < len(token_ids) and token_ids[j] == image_token:
                j += 1
            runs.append((i, j))
            i = j
        else:
            i += 1
    return runs


def expand_image_tokens(token_ids: list[int], image_token: int, counts: list[int]) -> list[int]:
    """Each run of image tokens is one image's: one token becomes its count, its count stays."""
    runs = image_token_runs(token_ids, image_token)
    if len(runs) != len(counts):
        raise RequestError(f"the prompt has {len(runs)} runs of image tokens ({image_token}) for {len(counts)} "
                           "images", param=PARAM)
    out, previous = [], 0
    for (start, end), count in zip(runs, counts):
        if end - start not in (1, count):
            raise RequestError(f"an image of {count} tokens has a run of {end - start} image tokens in the prompt "
                               "(one, or all of its tokens)", param=PARAM)
        out += token_ids[previous:start] + [image_token] * count
        previous = end
    return out + token_ids[previous:]


def expanded_position(token_ids: list[int], image_token: int, counts: list[int], index: int) -> int:
    """Where position ``index`` of the unexpanded prompt ``token_ids`` lies in the expanded one. An index
    inside an image's tokens is refused (``param`` "prompt_lengths")."""
    shift = 0
    for k, ((start, end), count) in enumerate(zip(image_token_runs(token_ids, image_token), counts)):
        if index <= start:
            break
        if index < end:
            raise RequestError(f"the prompt length {index} falls inside image {k}'s tokens", param="prompt_lengths")
        shift += count - (end - start)
    return index + shift


@dataclass(eq=False)
class PromptImages:
    """A prompt with its images processed (see the module's docstring)."""
    token_ids: list[int]          # the prompt with each image's tokens expanded
    pixel_values: torch.Tensor    # [patches of all images, C*T*P*P], the images in prompt order
    image_grid_thw: torch.Tensor  # long [images, 3]
    counts: list[int]             # image tokens per image
    digests: list[bytes]          # sha256 of each image's grid and processed pixels


def prepare_prompt_images(image_processor, config, token_ids: list[int], images) -> PromptImages:
    """``images`` (HxWx3 uint8 arrays or PIL images) processed one by one, and ``token_ids`` expanded;
    raises ``RequestError``."""
    if image_processor is None:
        raise RequestError("prompts with images need the model's processor", param=PARAM)
    processed = [process_image(image_processor, image, i) for i, image in enumerate(images)]
    merge = config.vision_config.spatial_merge_size
    counts = [int(grid.prod()) // merge ** 2 for _, grid in processed]
    digests = [hashlib.sha256(grid.numpy().astype("<i8").tobytes() + pixels.numpy().tobytes()).digest()
               for pixels, grid in processed]
    return PromptImages(expand_image_tokens(token_ids, config.image_token_id, counts),
                        torch.cat([p for p, _ in processed]), torch.cat([g for _, g in processed]), counts, digests)


@dataclass(eq=False)
class ImagePromptInputs(PromptInputs):
    """A prompt's images as ``PromptInputs``: its multimodal rope positions, its image tokens' embeddings
    replaced by the vision tower's features, each image's tokens salted with its digest."""

    @property
    def image_spans(self) -> list[tuple[int, int, bytes]]:
        """(first token, end, digest of the processed pixels) per image."""
        return self.salt_spans


class ImageInputs:
    """Turns a prompt's images into its ``ImagePromptInputs`` with the model's own image processor and vision
    tower. ``processor``: the checkpoint's processor (its ``image_processor``), or None."""

    def __init__(self, model, processor):
        self.model, self.image_processor = model, getattr(processor, "image_processor", None)
        self.image_token = model.config.image_token_id

    def prepare(self, token_ids: list[int], images) -> tuple[list[int], ImagePromptInputs]:
        """(the prompt with each image's tokens expanded, its inputs): each image processed
        (``prepare_prompt_images``) and encoded by the vision tower alone, so its features are those of the
        image alone; the positions computed from the prompt's own tokens. Raises ``RequestError``."""
        if self.image_processor is None:
            raise RequestError("requests with images need the model's processor: Engine(model, processor)",
                               param=PARAM)
        prompt = prepare_prompt_images(self.image_processor, self.model.config, token_ids, images)
        multimodal = self.model.model  # the vision tower and the language model
        ids = torch.tensor([prompt.token_ids])
        is_image = ids == self.image_token
        device = self.model.get_output_embeddings().weight.device
        grids = prompt.image_grid_thw.to(device)
        with torch.inference_mode():
            encoded = multimodal.get_image_features(prompt.pixel_values.to(device), grids)
            positions, delta = multimodal.get_rope_index(ids.to(device), is_image.to(device, torch.int32), grids)
        features = torch.cat(list(encoded.pooler_output))
        deepstack = [torch.cat(list(f)) if isinstance(f, (list, tuple)) else f
                     for f in (getattr(encoded, "deepstack_features", None) or [])]
        image_positions = is_image[0].nonzero().flatten().tolist()
        spans, first = [], 0
        for count, digest in zip(prompt.counts, prompt.digests):
            start = image_positions[first]
            spans.append((start, start + count, digest))
            first += count
        return prompt.token_ids, ImagePromptInputs(positions[:, 0].cpu(), int(delta.flatten()[0]),
                                                   EmbeddingOverrides(image_positions, features, deepstack), spans)
