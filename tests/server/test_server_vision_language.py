"""``serve`` on a vision-language checkpoint (Qwen2.5-VL; Qwen3-VL in the heavy tier), the app in process:
chat messages with ``image_url`` parts (base64 ``data:`` URLs) answer as the engine does for the same
prompt and image, requests sent together (two with images, one text-only, greedy and seeded) are
bitwise the same requests sent one at a time, and other URLs or undecodable images get a 400 naming
the message (``messages[0].content``)."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from transformers import AutoModelForImageTextToText, PreTrainedTokenizerFast
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from helpers.servers import MODEL, assert_error, choices_of, post, start_in_process_server
from helpers.vision import data_url, random_images, save_vision_checkpoint
from invariant_infer import make_invariant
from invariant_infer.checkpoints.loading import ImageProcessing
from invariant_infer.engine import Engine, SamplingParams

GRIDS = ((4, 6), (6, 4))  # patches per image: small images, so a request fits the server tests' body limit


@pytest.fixture(scope="module", params=["qwen2_5_vl", pytest.param("qwen3_vl", marks=pytest.mark.heavy)])
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"serve-{request.param}")
    config = save_vision_checkpoint(path, request.param, seed=2)
    return path, random_images(config, GRIDS, seed=1)


@pytest.fixture(scope="module")
def server(checkpoint):
    server = start_in_process_server(checkpoint[0])
    yield server
    server.stop()


def chat(text: str, image: np.ndarray | None = None, **options) -> dict:
    content = [{"type": "text", "text": text}]
    if image is not None:
        content.insert(0, {"type": "image_url", "image_url": {"url": data_url(image)}})
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4, "logprobs": True,
            **options}


def answer(response) -> list:
    assert response.status_code == 200, response.text
    return [(c["message"]["content"], [t["logprob"] for t in c["logprobs"]["content"]])
            for c in choices_of(response.json())]


def test_images_answer_as_the_engine_and_together_as_alone(server, checkpoint):
    path, images = checkpoint
    bodies = [chat("the cat runs", images[0], temperature=0), chat("a dog", images[1], temperature=0.9, seed=3),
              chat("the model", temperature=0)]
    alone = [answer(post(server, "/v1/chat/completions", body)) for body in bodies]
    with ThreadPoolExecutor(len(bodies)) as pool:
        together = list(pool.map(lambda body: answer(post(server, "/v1/chat/completions", body)), bodies))
    assert together == alone
    # The engine on the same prompt and pixels: the same tokens and logprobs.
    tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
    model = make_invariant(AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval())
    engine = Engine(model, ImageProcessing(Qwen2VLImageProcessorPil.from_pretrained(path), tokenizer))
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "image"},
                                                                        {"type": "text", "text": "the cat runs"}]}],
                                           tokenize=False, add_generation_prompt=True)
    out = engine.generate([{"prompt": prompt, "multi_modal_data": {"image": [images[0]]}}],
                          SamplingParams(max_tokens=4, logprobs=0))[0]
    assert alone[0] == [(out.text, out.logprobs)]


def test_other_urls_and_bad_images_are_refused(server, checkpoint):
    body = chat("the cat", checkpoint[1][0])
    body["messages"][0]["content"][0]["image_url"]["url"] = "https://example.com/cat.png"
    error = assert_error(post(server, "/v1/chat/completions", body), 400, "messages[0].content")
    assert "data: URLs" in error["message"]
    body["messages"][0]["content"][0]["image_url"]["url"] = "data:image/png;base64,bm90IGFuIGltYWdl"
    assert "not a decodable image" in assert_error(post(server, "/v1/chat/completions", body), 400)["message"]
