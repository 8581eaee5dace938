"""``token_logprobs`` on Qwen2.5-VL and Qwen3-VL (the vision tower frozen): the trainer's logprobs of rows
with images (one, two, none) equal the engine's sampled-token logprobs bitwise (processed, at the
sampling temperature), at micro-batches of 1 and 3 rows, left or right padded, and the backward runs
through the language model. Negative control: an M-dependent GEMM. Refused by name: a vision tower
that would train, packed rows (``position_ids``), images on a text model."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers import AutoModelForImageTextToText
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

import invariant_infer.model.layer_forwards
from helpers.controls import m_dependent_linear
from invariant_infer import NonInvariantInputError, make_invariant, pad_sequences
from invariant_infer.engine import Engine, SamplingParams
from invariant_infer.errors import InvalidArgumentError
from invariant_infer.testing.random_checkpoints import random_config, save_random_checkpoint
from invariant_infer.training import token_logprobs

T = 0.8
NEW_TOKENS = 4
IMAGE, START, END = 500, 502, 503


def make_rollouts(path, config, dtype):
    """(model, [(prompt + completion ids, pixel_values, image_grid_thw, the engine's logprobs)], a function that
    samples the prompts again on a new engine and returns their logprobs)."""
    model = make_invariant(AutoModelForImageTextToText.from_pretrained(path, dtype=dtype))
    model.model.visual.requires_grad_(False)
    patch = config.vision_config.patch_size
    processor = Qwen2VLImageProcessorPil(patch_size=patch, merge_size=2, min_pixels=(2 * patch) ** 2,
                                         max_pixels=(2 * patch) ** 2 * 64)
    rng = np.random.default_rng(2)
    images = [rng.integers(0, 256, (h * patch, w * patch, 3), dtype=np.uint8) for h, w in ((8, 6), (4, 10), (6, 4))]
    prompts = [{"prompt_token_ids": [5, 6, START, IMAGE, END, 7], "multi_modal_data": {"image": [images[0]]}},
               {"prompt_token_ids": [11, START, IMAGE, END, 12, START, IMAGE, END],
                "multi_modal_data": {"image": images[1:]}},
               {"prompt_token_ids": [20, 21, 22, 23, 24]}]
    params = [SamplingParams(max_tokens=NEW_TOKENS, temperature=T, seed=i, ignore_eos=True,
                             logprobs_mode="processed_logprobs") for i in range(len(prompts))]

    def sample():
        engine = Engine(model.eval(), SimpleNamespace(image_processor=processor, tokenizer=None),
                        max_num_batched_tokens=16)
        return engine, engine.generate(prompts, params)
    engine, outputs = sample()
    rows = []
    for prompt, out in zip(prompts, outputs):
        ids, _ = engine.prepare_images(*engine.split_prompt(prompt))
        pixels = [processor(images=[im], return_tensors="pt") for im in prompt.get("multi_modal_data", {}).get("image", [])]
        rows.append((ids + out.token_ids, [p["pixel_values"] for p in pixels], [p["image_grid_thw"] for p in pixels],
                     out.logprobs))
    return model.train(), rows, lambda: [out.logprobs for out in sample()[1]]


@pytest.fixture(scope="module", params=["qwen2_5_vl", pytest.param("qwen3_vl", marks=pytest.mark.heavy)])
def checkpoint(request, tmp_path_factory):
    config = random_config(request.param, "tiny")
    return save_random_checkpoint(tmp_path_factory.mktemp(request.param), config, seed=4), config


@pytest.fixture(scope="module")
def rollouts(checkpoint):
    return make_rollouts(*checkpoint, torch.bfloat16)


def trainer_logprobs(model, rows, side: str) -> list[list[float]]:
    """The completion tokens' logprobs of each row, from token_logprobs over these rows as one micro-batch."""
    ids, mask = pad_sequences([r[0] for r in rows], side=side)
    images = {}
    if any(r[1] for r in rows):
        images = dict(pixel_values=torch.cat([p for r in rows for p in r[1]]),
                      image_grid_thw=torch.cat([g for r in rows for g in r[2]]))
    logps = token_logprobs(model, ids, mask, temperature=T, **images)
    out = []
    for b, row in enumerate(rows):
        end = ids.shape[1] - 1 if side == "left" else len(row[0]) - 1
        out.append(logps[b, end - NEW_TOKENS:end].tolist())
    return out, logps


def test_trainer_logprobs_equal_the_engines_at_any_micro_batch(rollouts):
    model, rows, _ = rollouts
    for side in ("left", "right"):
        got, logps = trainer_logprobs(model, rows, side)
        assert got == [r[3] for r in rows]
        for row in rows:  # micro-batches of one row
            assert trainer_logprobs(model, [row], side)[0] == [row[3]]
    logps.sum().backward()
    grads = [p.grad for p in model.model.language_model.parameters() if p.grad is not None]
    assert grads and all(bool(torch.isfinite(g).all()) for g in grads)
    model.zero_grad(set_to_none=True)


@pytest.mark.heavy  # CI time: a second rollout in fp32; the model-level tests' controls run in the fast tier
def test_negative_control_an_m_dependent_gemm(checkpoint, monkeypatch):
    """The sampler's decode steps (3 rows) take another K tile than its prefill and the trainer's micro-batch;
    fp32, where a reordered sum shows."""
    with monkeypatch.context() as patched:
        patched.setattr(invariant_infer.model.layer_forwards, "linear", m_dependent_linear)
        model, rows, _ = make_rollouts(*checkpoint, torch.float32)
    assert trainer_logprobs(model, rows, "left")[0] != [r[3] for r in rows]


def test_refusals(rollouts):
    model, rows, _ = rollouts
    ids, mask = pad_sequences([rows[0][0]])
    images = dict(pixel_values=rows[0][1][0], image_grid_thw=rows[0][2][0])
    model.model.visual.requires_grad_(True)
    try:
        with pytest.raises(NonInvariantInputError, match="vision tower"):
            token_logprobs(model, ids, mask, **images)
    finally:
        model.model.visual.requires_grad_(False)
    with pytest.raises(NonInvariantInputError, match="position_ids"):
        token_logprobs(model, ids, mask, position_ids=torch.arange(ids.shape[1])[None], **images)
    with pytest.raises(InvalidArgumentError, match="unexpected arguments"):
        token_logprobs(model, ids, mask, pixel_values_videos=images["pixel_values"])
