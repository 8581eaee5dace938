"""The engine's frontend: what turns a caller's prompt into the core's token ids, and the core's
deltas into the caller's outputs. ``Engine`` and ``AsyncEngine`` share one ``Frontend`` over one
``EngineCore``; neither holds a copy of this logic.

In: a prompt is text (encoded with the tokenizer, no special tokens added), token ids, or vLLM's
multimodal form ``{"prompt_token_ids": ids (or "prompt": text), "multi_modal_data": {"image": ...}}``;
a vision-language model's images go through its processor's image processor and the model's vision
tower into the prompt's ``PromptInputs`` (``model.image_inputs.ImageInputs``). Out: one
``OutputProcessor`` per request builds its outputs from its deltas (text, stop strings, output kind).
"""
from __future__ import annotations

from collections.abc import Sequence as SequenceABC

import torch

from ..errors import RequestError
from ..model.families import is_vision_language
from ..model.image_inputs import ImageInputs, split_multimodal
from .output import OutputProcessor
from .sampling_params import SamplingParams


class Frontend:
    """Prompt preparation and output processors over one core (see the module's docstring).
    ``processor``: a vision-language model's processor (its ``image_processor``), or None."""

    def __init__(self, core, processor=None):
        self.core = core
        self.tokenizer = core.tokenizer
        self.images = ImageInputs(core.model, processor) if is_vision_language(core.model.config) else None

    def encode(self, prompt) -> list[int]:
        """A prompt's token ids (a string needs the tokenizer; a list of ids is checked and copied)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("a text prompt needs a tokenizer: Engine(model, tokenizer)")
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        prompt = prompt.tolist() if isinstance(prompt, torch.Tensor) else prompt
        if not isinstance(prompt, SequenceABC) or not all(type(t) is int for t in prompt):
            raise RequestError("a prompt is a string or a list of token ids")
        return list(prompt)

    def split_prompt(self, prompt) -> tuple[list[int], list | None]:
        """(token ids, images or None) of a prompt in any of the module docstring's forms."""
        if not isinstance(prompt, dict):
            return self.encode(prompt), None
        content, images = split_multimodal(prompt)
        return self.encode(content), images

    def prepare_images(self, prompt_ids: list[int], images) -> tuple[list[int], object]:
        """(the prompt with its image tokens expanded, its ``PromptInputs``); (prompt_ids, None) without images.
        Runs the vision tower: the caller holds the core (no step runs meanwhile)."""
        if not images:
            return prompt_ids, None
        if self.images is None:
            raise RequestError("this model takes no images", param="multi_modal_data")
        return self.images.prepare(prompt_ids, images)

    def output_processor(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                         seed: int) -> OutputProcessor:
        """The processor of one request the core queued (its id and seed are the core's)."""
        return OutputProcessor(request_id, prompt_ids, params, seed, self.tokenizer)
