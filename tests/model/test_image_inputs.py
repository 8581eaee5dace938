"""The prompt expansion the engine and scoring run (``invariant_infer.model.image_inputs``) against the
checkpoint's own Qwen-VL processor: for one image, two images in a row, and images of several sizes, the
expanded ids equal the processor's ``input_ids``, the pixel values and grids are bitwise its own, and the
token counts from the images' sizes alone equal the processed ones."""
from __future__ import annotations

import pytest
import torch

from helpers.vision import image_processor_only, random_images, save_vision_checkpoint
from invariant_infer.model.image_inputs import expanded_position, image_token_count, prepare_prompt_images

PAD = "<|vision_start|><|image_pad|><|vision_end|>"
TEXTS = [f"the cat {PAD} runs", f"{PAD} a dog {PAD} to the model", f"score {PAD}{PAD} fast"]


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_expansion_and_pixels_equal_the_processor(tmp_path, family):
    config = save_vision_checkpoint(tmp_path, family, seed=0)
    processor = image_processor_only(tmp_path)
    images = random_images(config, ((4, 6), (8, 2), (2, 2)), seed=3)
    for text, row_images in zip(TEXTS, ([images[0]], images[1:], [images[2], images[0]])):
        want = processor(text=[text], images=row_images, return_tensors="pt")
        ids = processor.tokenizer.encode(text, add_special_tokens=False)
        got = prepare_prompt_images(processor.image_processor, config, ids, row_images)
        assert got.token_ids == want["input_ids"][0].tolist()
        assert torch.equal(got.pixel_values, want["pixel_values"])
        assert torch.equal(got.image_grid_thw, want["image_grid_thw"])
        # The token counts from the images' sizes alone (the score command's count when it reads a line).
        assert [image_token_count(processor.image_processor, config, *im.shape[:2]) for im in row_images] == got.counts
        # A prompt length after the last image moves by the images' extra tokens.
        assert expanded_position(ids, config.image_token_id, got.counts, len(ids)) == len(got.token_ids)


def test_the_image_processor_loads_without_torchvision(tmp_path, monkeypatch):
    """Where ``AutoImageProcessor`` maps the checkpoint to a torchvision class that cannot load (transformers
    5.17 without torchvision), its PIL class loads instead, with the saved settings."""
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from invariant_infer.checkpoints.loading import load_image_processor
    save_vision_checkpoint(tmp_path, "qwen2_5_vl", seed=0)
    saved = load_image_processor(tmp_path)

    def needs_torchvision(*args, **kwargs):
        raise ImportError("AutoImageProcessor requires the Torchvision library")
    try:
        transformers.AutoImageProcessor.from_pretrained  # noqa: B018  (5.17 without torchvision: raises here)
    except ImportError:
        pass  # this transformers is the case itself
    else:
        monkeypatch.setattr(transformers.AutoImageProcessor, "from_pretrained", needs_torchvision)
    loaded = load_image_processor(tmp_path)
    assert type(loaded) is Qwen2VLImageProcessorPil
    assert (loaded.patch_size, loaded.merge_size) == (saved.patch_size, saved.merge_size)
