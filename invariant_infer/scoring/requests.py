"""A scoring request's fields turned into token ids (and images), as the score command and the Ray job read them."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ..checkpoints.loading import LazyTokenizer
from ..errors import ScoringRequestError
from ..model.image_inputs import (PromptImages, expand_image_tokens, expanded_position, image_token_count,
                                  open_image)
from .core import prepare_sequence

# The four shapes of a scoring request, besides its id.
REQUEST_FIELDS = (("input_ids",), ("text",), ("prompt", "completion"), ("prompt_ids", "completion_ids"))
OPTIONAL_FIELDS = {"id", "lora", "images"}  # lora: an adapter's name; images: image sources
KNOWN_FIELDS = OPTIONAL_FIELDS | {name for fields in REQUEST_FIELDS for name in fields}  # lora: an adapter's name


def _token_list(value, name: str) -> list[int]:
    if not isinstance(value, list) or not all(type(t) is int for t in value):
        raise ScoringRequestError(f"{name} must be a list of integers")
    return value


def _encode(tokenizer: LazyTokenizer, text, name: str) -> list[int]:
    if not isinstance(text, str):
        raise ScoringRequestError(f"{name} must be a string")
    try:
        loaded = tokenizer.get()
    except OSError as exc:
        raise ScoringRequestError(f"cannot tokenize: {exc}") from None
    return loaded.encode(text, add_special_tokens=False)


def request_lora(record: dict, loras) -> str | None:
    """The request's LoRA adapter (``lora``: a name among ``loras``; absent or null: the base model)."""
    name = record.get("lora")
    if name is not None and (not isinstance(name, str) or name not in loras):
        known = ", ".join(sorted(loras)) or "none (--lora NAME=PATH loads one)"
        raise ScoringRequestError(f"unknown LoRA adapter {name!r} (loaded: {known})")
    return name


def parse_request(record: dict, tokenizer: LazyTokenizer) -> tuple[list[int], int]:
    """(token ids, prompt length) of one scoring request: ``input_ids``, ``text``, ``prompt`` +
    ``completion`` (tokenized separately, no special tokens, ids concatenated) or ``prompt_ids`` +
    ``completion_ids``, besides an optional ``id``, ``lora`` (``request_lora``) and ``images``
    (``request_images``). Raises ``ScoringRequestError``."""
    fields = set(record) - OPTIONAL_FIELDS
    unknown = sorted(fields - KNOWN_FIELDS)
    if unknown:
        raise ScoringRequestError(f"unknown field(s) {unknown}")
    if fields == {"input_ids"}:
        return _token_list(record["input_ids"], "input_ids"), 1
    if fields == {"text"}:
        return _encode(tokenizer, record["text"], "text"), 1
    if fields == {"prompt", "completion"}:
        prompt = _encode(tokenizer, record["prompt"], "prompt")
        return prompt + _encode(tokenizer, record["completion"], "completion"), len(prompt)
    if fields == {"prompt_ids", "completion_ids"}:
        prompt = _token_list(record["prompt_ids"], "prompt_ids")
        return prompt + _token_list(record["completion_ids"], "completion_ids"), len(prompt)
    for needed in REQUEST_FIELDS:
        if fields and fields <= set(needed):
            raise ScoringRequestError(f"missing field(s) {sorted(set(needed) - fields)}")
    expected = " | ".join("+".join(f) for f in REQUEST_FIELDS)
    raise ScoringRequestError(f"need exactly one of {expected}; got {sorted(fields) or 'none'}")


def request_images(record: dict, folder: Path) -> list[str] | None:
    """The request's ``images`` (None without): base64 ``data:`` URLs or image files (a relative path is
    read from ``folder``, the input file's), one per run of image tokens in its ids, in order."""
    sources = record.get("images")
    if sources is None:
        return None
    if not isinstance(sources, list) or not sources or not all(isinstance(s, str) and s for s in sources):
        raise ScoringRequestError("images must be a non-empty list of strings (data: URLs or image file paths)")
    return [s if s.startswith("data:") else str(folder / s) for s in sources]


def load_image(source: str, index: int) -> np.ndarray:
    """Image ``index`` of a request, HxWx3 uint8, from its data: URL or file; raises ``ScoringRequestError``."""
    try:
        with open_image(source) as image:
            return np.asarray(image.convert("RGB"), dtype=np.uint8)
    except (ValueError, OSError) as exc:
        raise ScoringRequestError(f"images[{index}]: {exc}") from None


def _size(source: str, index: int) -> tuple[int, int]:
    """(height, width) of image ``index`` from its header; raises ``ScoringRequestError``."""
    try:
        with open_image(source) as image:
            return image.height, image.width
    except (ValueError, OSError) as exc:
        raise ScoringRequestError(f"images[{index}]: {exc}") from None


def count_request_images(config, image_processor, ids: list[int], prompt_length: int,
                         sources: list[str]) -> tuple[list[int], int]:
    """(ids with each image's tokens expanded, the prompt length in them) of a request with images, from the
    images' sizes (their headers) and the processor's resize rule, without processing their pixels (a
    processor that has no such rule processes them). Raises ``ScoringRequestError``."""
    if image_processor is None:
        raise ScoringRequestError(f"images: {config.model_type} takes no images")
    counts = [image_token_count(image_processor, config, *_size(source, k)) for k, source in enumerate(sources)]
    if None in counts:
        return prepare_request_images(config, image_processor, ids, prompt_length, sources)[:2]
    try:
        expanded = expand_image_tokens(ids, config.image_token_id, counts)
        return expanded, expanded_position(ids, config.image_token_id, counts, prompt_length)
    except ValueError as exc:
        raise ScoringRequestError(f"images: {exc}") from None


def prepare_request_images(config, image_processor, ids: list[int], prompt_length: int,
                           sources: list[str]) -> tuple[list[int], int, PromptImages]:
    """(ids with each image's tokens expanded, the prompt length in them, the processed images) of a request
    with images, each image processed alone; raises ``ScoringRequestError``."""
    if image_processor is None:
        raise ScoringRequestError(f"images: {config.model_type} takes no images")
    images = [load_image(source, k) for k, source in enumerate(sources)]
    try:
        return prepare_sequence(config, image_processor, ids, prompt_length, images)
    except ValueError as exc:
        raise ScoringRequestError(f"images: {exc}") from None
