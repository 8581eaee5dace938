"""The engine on Qwen2.5-VL and Qwen3-VL: requests in vLLM's form (``prompt_token_ids`` with one image
token per image, ``multi_modal_data`` with HxWx3 uint8 images), ``Engine(model, processor)``.

A busy engine (prefill chunks that cut images' tokens, requests joining mid-decode, a text-only
request beside them) gives each request its tokens and logprobs alone, which equal ``model.generate``
on the same images; seeded sampling too. Prefix caching keys pages by the images' pixels: the same
tokens with another image never hit, the same image hits and changes nothing. Videos, images without
a processor, placeholders that do not match the images and the engine's options that do not run with
images yet are refused by name. ``engine.score`` on sequences with images equals ``token_logprobs``."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers import AutoModelForImageTextToText
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from invariant_infer import UnsupportedModelError, make_invariant
from invariant_infer.engine import Engine, SamplingParams
from invariant_infer.engine.decode_graphs import DecodeGraphs, rerun_capture
from invariant_infer.errors import RequestError
from invariant_infer.testing.random_checkpoints import random_config, save_random_checkpoint

IMAGE, START, END = 500, 502, 503  # the tiny presets' image, vision-start and vision-end token ids
GRIDS = ((8, 6), (4, 10), (6, 4))  # patches per image (12, 10 and 6 tokens)
GREEDY = SamplingParams(max_tokens=5, logprobs=0)


def cells(fast: str) -> list:
    return [pytest.param(f, marks=() if f == fast else pytest.mark.heavy) for f in ("qwen2_5_vl", "qwen3_vl")]


@pytest.fixture(scope="module")
def setups(tmp_path_factory):
    """Per family: (checkpoint, processor, raw images)."""
    out = {}
    for family in ("qwen2_5_vl", "qwen3_vl"):
        config = random_config(family, "tiny")
        patch = config.vision_config.patch_size
        side = 2 * patch
        processor = SimpleNamespace(tokenizer=None, image_processor=Qwen2VLImageProcessorPil(
            patch_size=patch, merge_size=2, min_pixels=side * side, max_pixels=side * side * 64))
        rng = np.random.default_rng(0)
        images = [rng.integers(0, 256, (h * patch, w * patch, 3), dtype=np.uint8) for h, w in GRIDS]
        path = save_random_checkpoint(tmp_path_factory.mktemp(family), config, seed=1)
        out[family] = (path, processor, images)
    return out


def load(path, dtype=torch.float32):
    return make_invariant(AutoModelForImageTextToText.from_pretrained(path, dtype=dtype).eval())


def request(before, image_ids, after, images, between=(12,)):
    """vLLM's form: one image token per image between vision start and end tokens."""
    ids = list(before)
    for k, i in enumerate(image_ids):
        ids += ([] if k == 0 else list(between)) + [START, IMAGE, END]
    return {"prompt_token_ids": ids + list(after), "multi_modal_data": {"image": [images[i] for i in image_ids]}}


def requests(images):
    return [request([5, 6, 7], [0], [8, 9], images), request([11], [1, 2], [13, 14, 15], images),
            [20, 21, 22, 23, 24], request([30, 31], [2], [], images)]


def pixel_inputs(processor, prompt) -> dict:
    """``pixel_values`` and ``image_grid_thw`` of a prompt's images, each processed alone (as the engine does);
    none for a text prompt."""
    images = prompt.get("multi_modal_data", {}).get("image", []) if isinstance(prompt, dict) else []
    if not images:
        return {}
    pixels = [processor.image_processor(images=[image], return_tensors="pt") for image in images]
    return dict(pixel_values=torch.cat([p["pixel_values"] for p in pixels]),
                image_grid_thw=torch.cat([p["image_grid_thw"] for p in pixels]))


def run(engine, prompts, params=GREEDY):
    return [(o.token_ids, o.logprobs) for o in engine.generate(prompts, params)]


@pytest.mark.parametrize("family", cells("qwen2_5_vl"))
def test_busy_engine_equals_alone_and_generate(setups, family):
    path, processor, images = setups[family]
    model = load(path)
    prompts = requests(images)
    alone = [run(Engine(model, processor), [p])[0] for p in prompts]
    # Chunks of 16 tokens cut the images' tokens; requests join while others decode.
    busy = Engine(model, processor, max_num_batched_tokens=16, max_num_seqs=3)
    got = {}
    for i, prompt in enumerate(prompts):
        busy.add_request(prompt, GREEDY, request_id=str(i))
        for output in busy.step():
            got[output.request_id] = output
    while busy.has_unfinished():
        for output in busy.step():
            got[output.request_id] = output
    assert [(got[str(i)].token_ids, got[str(i)].logprobs) for i in range(len(prompts))] == alone
    # model.generate on the same images (each alone: its own prompt, processed the same way)
    for prompt, (tokens, _) in zip(prompts, alone):
        ids, _ = busy.prepare_images(*busy.split_prompt(prompt))
        out = model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=GREEDY.max_tokens, do_sample=False, pad_token_id=0,
                             **pixel_inputs(processor, prompt))
        assert out[0, len(ids):].tolist() == tokens


@pytest.mark.heavy
def test_replayed_decode_steps_equal_alone(setups):
    """Decode steps replayed from their buckets' captures (``engine/decode_graphs.py``; on CPU a replay
    runs the captured closure again over the objects it captured): after prompts with images, each
    request's tokens and logprobs are its own alone (generated tokens' positions on the three rope axes,
    offset by the images, come from the runner's buffers)."""
    path, processor, images = setups["qwen2_5_vl"]
    model = load(path)
    prompts = requests(images)
    alone = [run(Engine(model, processor), [p])[0] for p in prompts]
    engine = Engine(model, processor, max_num_seqs=4, decode_buckets=(1, 2, 4))
    engine.core.runner.decode_graphs = DecodeGraphs(rerun_capture)
    assert run(engine, prompts) == alone
    assert engine.core.runner.decode_graphs.num_replays >= GREEDY.max_tokens - 1


@pytest.mark.heavy  # seeded sampling is each family's: the model-level generate test samples with images
@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_seeded_sampling_equals_alone(setups, family):
    path, processor, images = setups[family]
    model = load(path, torch.bfloat16)
    prompts = requests(images)
    params = [SamplingParams(max_tokens=5, temperature=0.9, top_k=40, seed=100 + i, logprobs=0)
              for i in range(len(prompts))]
    together = [(o.token_ids, o.logprobs) for o in Engine(model, processor, max_num_batched_tokens=24)
                .generate(prompts, params)]
    for prompt, p, want in zip(prompts, params, together):
        assert run(Engine(model, processor), [prompt], p)[0] == want


@pytest.mark.parametrize("family", cells("qwen3_vl"))
def test_prefix_cache_keys_pages_by_image(setups, family):
    path, processor, images = setups[family]
    model = load(path)
    # 40 text tokens, then the image: the first page (64 tokens on CPU) holds both.
    first = request(list(range(40, 80)), [0], list(range(100, 140)), images)
    other = {**first, "multi_modal_data": {"image": [images[2]]}}  # same token ids before expansion
    other["prompt_token_ids"] = list(first["prompt_token_ids"])
    swapped = request(list(range(40, 80)), [1], list(range(100, 140)), images)
    alone = {name: run(Engine(model, processor), [p])[0] for name, p in (("first", first), ("swapped", swapped))}
    engine = Engine(model, processor)
    assert run(engine, [first]) == [alone["first"]]
    hits = engine.core.blocks.prefix_hits
    assert run(engine, [swapped]) == [alone["swapped"]]
    assert engine.core.blocks.prefix_hits == hits  # another image: no page of the first request matches
    assert run(engine, [first]) == [alone["first"]]
    assert engine.core.blocks.prefix_hits > hits  # the same image: its pages hit
    with pytest.raises(RequestError, match="runs of image tokens|image tokens"):
        engine.generate([{**other, "multi_modal_data": {"image": [images[2], images[0]]}}], GREEDY)


def test_refusals_name_what_is_not_supported(setups):
    path, processor, images = setups["qwen2_5_vl"]
    model = load(path)
    engine = Engine(model, processor)
    prompt = request([5], [0], [6], images)
    with pytest.raises(RequestError, match="videos"):
        engine.generate([{**prompt, "multi_modal_data": {"video": [images[0]]}}], GREEDY)
    with pytest.raises(RequestError, match="processor"):
        Engine(model).generate([prompt], GREEDY)
    with pytest.raises(RequestError, match=r"1 runs of image tokens \(500\) for 2 images"):
        engine.generate([{**prompt, "multi_modal_data": {"image": images[:2]}}], GREEDY)
    with pytest.raises(RequestError, match="HxWx3 uint8"):
        engine.generate([{**prompt, "multi_modal_data": {"image": [images[0].astype(np.float32)]}}], GREEDY)
    for options in (dict(max_loras=1), dict(speculative={"method": "ngram", "num_speculative_tokens": 2})):
        with pytest.raises(UnsupportedModelError, match="qwen2_5_vl: .*does not run .*vision-language models"):
            Engine(model, processor, **options)


def test_score_with_images_equals_token_logprobs(setups):
    """engine.score on sequences with images (the prompt length counted with one token per image) gives
    token_logprobs' values at temperature 1 after the expanded prompt, bitwise."""
    from invariant_infer.model.image_inputs import expanded_position
    from invariant_infer.training import token_logprobs
    path, processor, images = setups["qwen2_5_vl"]
    model = load(path)
    engine = Engine(model, processor)
    sequences = [request([5, 6], [0], [8, 9, 10, 11], images), request([11], [1, 2], [13, 14], images),
                 [20, 21, 22, 23]]
    prompt_lengths = [4, 9, 2]  # after the image, after both images, text only
    results = engine.score(sequences, prompt_lengths)
    for sequence, start, result in zip(sequences, prompt_lengths, results):
        ids, mm = engine.prepare_images(*engine.split_prompt(sequence))
        if mm is not None:
            start = expanded_position(sequence["prompt_token_ids"], IMAGE, [e - s for s, e, _ in mm.image_spans],
                                      start)
        with torch.no_grad():
            want = token_logprobs(model, torch.tensor([ids]), **pixel_inputs(processor, sequence))[0, start - 1:]
        assert torch.equal(result.token_logprobs, want)
    expanded = {**request([5], [0], [6], images), "prompt_token_ids": [5, START] + [IMAGE] * 12 + [END, 6]}
    with pytest.raises(RequestError, match="inside image"):  # a prompt cut inside the image's 12 tokens
        engine.score([expanded], [5])
