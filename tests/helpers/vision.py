"""Tiny vision-language checkpoints as users have them: random weights, a trained BPE tokenizer with the
Qwen-VL vision tokens and a chat template of the Qwen-VL shape, and the image processor saved beside
them; random images and their base64 ``data:`` URLs."""
from __future__ import annotations

import base64
import io

import numpy as np
from PIL import Image
from transformers import AutoConfig, PreTrainedTokenizerFast
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from helpers.tokenizer import train_tokenizer
from invariant_infer.checkpoints.loading import load_image_processor
from invariant_infer.testing.random_checkpoints import random_config, save_random_checkpoint

VISION_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]
# The Qwen-VL templates' shape: an image part becomes <|vision_start|><|image_pad|><|vision_end|>.
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {% if m['content'] is string %}{{ m['content'] }}"
                 "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}"
                 "<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ p['text'] }}{% endif %}{% endfor %}"
                 "{% endif %}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")


def save_vision_checkpoint(path, family: str, seed: int):
    """A tiny ``family`` checkpoint at ``path`` with its tokenizer and image processor; returns its config."""
    train_tokenizer(path)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    start, image, end = tokenizer.convert_tokens_to_ids(VISION_TOKENS)
    config = random_config(family, "tiny", image_token_id=image, vision_start_token_id=start,
                           vision_end_token_id=end)
    save_random_checkpoint(path, config, seed=seed)
    patch = config.vision_config.patch_size
    Qwen2VLImageProcessorPil(patch_size=patch, merge_size=2, min_pixels=(2 * patch) ** 2,
                             max_pixels=(2 * patch) ** 2 * 64).save_pretrained(path)
    return config


def random_images(config, grids, seed: int) -> list[np.ndarray]:
    """HxWx3 uint8 images of (rows, columns) patches each."""
    patch = config.vision_config.patch_size
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (h * patch, w * patch, 3), dtype=np.uint8) for h, w in grids]


def data_url(image: np.ndarray) -> str:
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG")  # lossless: the reader decodes these very pixels
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def image_processor_only(path):
    """The checkpoint's Qwen-VL processor (tokenizer, image processor, chat template) without a video
    processor: ``AutoProcessor`` builds one, which needs torchvision, and these tests install none (the
    image processor as ``load_image_processor`` loads it: its PIL class without torchvision)."""
    from transformers import AutoTokenizer
    from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    config = AutoConfig.from_pretrained(path)
    base = {"qwen2_5_vl": Qwen2_5_VLProcessor, "qwen3_vl": Qwen3VLProcessor}[config.model_type]

    class ImagesOnlyProcessor(base):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template)  # no video processor

    tokenizer = AutoTokenizer.from_pretrained(path)
    return ImagesOnlyProcessor(load_image_processor(path), tokenizer,
                               chat_template=tokenizer.chat_template)
