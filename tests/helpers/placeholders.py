"""A tiny vision-language model whose image and video placeholders are what it would sample: the same
random weights twice, the second with the lm_head rows of ``image_token_id`` and ``video_token_id``
replaced by 4x the rows of the tokens the first model picks greedily after ``PROMPTS[0]`` and
``PROMPTS[1]``. Every other logit is bitwise the first model's (each logit is its own row's dot product)."""
from __future__ import annotations

import torch
from transformers import AutoModelForImageTextToText

from invariant_infer import make_invariant
from invariant_infer.model.image_inputs import placeholder_token_ids
from invariant_infer.testing.random_checkpoints import random_config

PROMPTS = ([5, 6, 7, 8, 9], [20, 21, 22], [40, 41, 42, 43])


def _build(config):
    torch.manual_seed(0)
    return AutoModelForImageTextToText.from_config(config).eval()


def placeholder_models(family: str = "qwen2_5_vl"):
    """(plain, rigged) invariant models of one tiny ``family`` config, and its (image, video) token ids."""
    config = random_config(family, "tiny")
    image, video = placeholder_token_ids(config)
    plain, rigged = _build(config), _build(config)
    with torch.no_grad():
        picks = [plain(input_ids=torch.tensor([p])).logits[0, -1] for p in PROMPTS[:2]]
        head = rigged.get_output_embeddings().weight
        for placeholder, logits in zip((image, video), picks):
            assert logits.max() > 0  # so 4x its row makes the placeholder the argmax there
            head[placeholder] = 4 * head[int(logits.argmax())]
    return make_invariant(plain), make_invariant(rigged), (image, video)
