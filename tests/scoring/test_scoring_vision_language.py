"""Scoring with images on Qwen2.5-VL (Qwen3-VL in the heavy tier), checkpoints saved with their
tokenizer and image processor and loaded as users load them.

``score_sequences`` takes sequences in vLLM's form (``prompt_token_ids`` with one image token per
image, ``multi_modal_data``) and a processor. Each sequence's logprobs are bitwise the same alone,
together and in any order, equal the engine's ``score`` and lie within fp32 rounding of a stock
``log_softmax`` on the same pixels. ``invariant-infer score`` takes an ``images`` field (``data:`` URLs
or files beside the input) with ids or text, gives the digests of ``score_sequences`` at any
``--max-batch-tokens``, and turns bad images into error rows."""
from __future__ import annotations

import functools

import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoTokenizer

import invariant_infer.model.layer_forwards
import invariant_infer.model.logits
from helpers.controls import m_dependent_linear
from helpers.models import load_model
from helpers.scoring_rows import read_rows, write_jsonl
from helpers.vision import data_url, random_images, save_vision_checkpoint
from invariant_infer import make_invariant
from invariant_infer.checkpoints.loading import load_image_processor
from invariant_infer.cli import exit_codes, score as scoring_cli
from invariant_infer.engine import Engine
from invariant_infer.errors import InvalidArgumentError
from invariant_infer.scoring.core import score_sequences

GRIDS = ((8, 6), (4, 10), (6, 4))  # patches per image (12, 10 and 6 tokens)
TOLERANCE_VS_STOCK_FP32 = 1e-5  # fp32, as for the text models (tests/scoring/test_scoring.py)


@pytest.fixture(scope="module", params=["qwen2_5_vl", pytest.param("qwen3_vl", marks=pytest.mark.heavy)])
def checkpoint(request, tmp_path_factory):
    """(path, config, image processor, tokenizer, images)."""
    path = tmp_path_factory.mktemp(f"score-{request.param}")
    config = save_vision_checkpoint(path, request.param, seed=4)
    return (path, config, load_image_processor(path), AutoTokenizer.from_pretrained(path),
            random_images(config, GRIDS, seed=5))


def load(path, invariant: bool = True):
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    return make_invariant(model) if invariant else model


def sequences_of(config, images) -> tuple[list, list[int]]:
    """One image, two images, text only and an image in the scored part; the prompt lengths counted with
    one token per image."""
    start, image, end = config.vision_start_token_id, config.image_token_id, config.vision_end_token_id
    pad = [start, image, end]
    sequences = [{"prompt_token_ids": [5, 6] + pad + [8, 9, 10, 11], "multi_modal_data": {"image": [images[0]]}},
                 {"prompt_token_ids": [11] + pad + [12] + pad + [13, 14], "multi_modal_data": {"image": images[1:]}},
                 [20, 21, 22, 23, 24, 25],
                 {"prompt_token_ids": [30, 31] + pad + [32], "multi_modal_data": {"image": images[2]}}]
    return sequences, [6, 9, 2, 1]


def test_any_batching_equals_alone_and_the_engine(checkpoint):
    path, config, image_processor, _, images = checkpoint
    model = load(path)
    sequences, prompt_lengths = sequences_of(config, images)
    together = score_sequences(model, sequences, prompt_lengths=prompt_lengths, processor=image_processor)
    alone = score_sequences(model, sequences, prompt_lengths=prompt_lengths, processor=image_processor,
                            max_batch_tokens=1)
    reverse = score_sequences(model, sequences[::-1], prompt_lengths=prompt_lengths[::-1],
                              processor=image_processor)[::-1]
    engine = Engine(model, type("Processor", (), {"image_processor": image_processor})()).score(sequences,
                                                                                                prompt_lengths)
    assert [r.num_tokens for r in together] == [3, 1, 4, 5 + 5]  # the last scores its image's 6 tokens too
    for got in (alone, reverse, engine):
        assert all(torch.equal(a.token_logprobs, b.token_logprobs) for a, b in zip(got, together))


def test_close_to_stock_fp32_log_softmax(checkpoint):
    path, config, image_processor, _, images = checkpoint
    sequences, prompt_lengths = sequences_of(config, images)
    scored = score_sequences(load(path), sequences[:1], prompt_lengths=prompt_lengths[:1], processor=image_processor)
    stock = load(path, invariant=False)
    processed = image_processor(images=[images[0]], return_tensors="pt")
    counts = int(processed["image_grid_thw"].prod()) // 4
    ids = [5, 6, config.vision_start_token_id] + [config.image_token_id] * counts + [config.vision_end_token_id,
                                                                                    8, 9, 10, 11]
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        logits = stock(input_ids=input_ids, mm_token_type_ids=(input_ids == config.image_token_id).int(),
                       **processed).logits[0]
    start = 5 + counts
    want = torch.log_softmax(logits.float(), -1)[start - 1:-1].gather(1, input_ids[0, start:, None])[:, 0]
    assert (scored[0].token_logprobs - want).abs().max().item() <= TOLERANCE_VS_STOCK_FP32


@pytest.mark.parametrize("checkpoint", ["qwen2_5_vl"], indirect=True)  # one family is enough here
def test_negative_control_an_m_dependent_gemm(checkpoint, monkeypatch):
    path, config, image_processor, _, images = checkpoint
    model = load(path)
    sequences, prompt_lengths = sequences_of(config, images)
    # BLOCK_K by M: a sequence alone has at most 31 tokens, the batch more.
    control = functools.partial(m_dependent_linear, small_m=31)
    monkeypatch.setattr(invariant_infer.model.layer_forwards, "linear", control)
    monkeypatch.setattr(invariant_infer.model.logits, "linear", control)
    together = score_sequences(model, sequences, prompt_lengths=prompt_lengths, processor=image_processor)
    alone = score_sequences(model, sequences, prompt_lengths=prompt_lengths, processor=image_processor,
                            max_batch_tokens=1)
    assert not all(torch.equal(a.token_logprobs, b.token_logprobs) for a, b in zip(alone, together))


@pytest.mark.parametrize("checkpoint", ["qwen2_5_vl"], indirect=True)  # one family is enough here
def test_refusals(checkpoint, tiny_checkpoint):
    path, config, image_processor, _, images = checkpoint
    model = load(path)
    sequence = {"prompt_token_ids": [5, config.vision_start_token_id, config.image_token_id,
                                     config.vision_end_token_id, 6], "multi_modal_data": {"image": [images[0]]}}
    # The image's 12 tokens already expanded, the prompt cut among them.
    expanded = {**sequence, "prompt_token_ids": [5, config.vision_start_token_id] + [config.image_token_id] * 12
                + [config.vision_end_token_id, 6]}
    cases = [
        (dict(sequences=[sequence]), "need the model's processor"),
        (dict(sequences=[expanded], processor=image_processor, prompt_lengths=[5]), "inside image 0"),
        (dict(sequences=[{**sequence, "multi_modal_data": {"image": images[:2]}}], processor=image_processor),
         "1 runs of image tokens"),
        (dict(sequences=[{**sequence, "multi_modal_data": {"video": [images[0]]}}], processor=image_processor),
         "does not run videos"),
        (dict(sequences=[{**sequence, "images": []}], processor=image_processor), "got the keys"),
        (dict(sequences=[{"prompt": "text", "multi_modal_data": {}}]), "token ids .* not text"),
    ]
    for kwargs, match in cases:
        with pytest.raises(InvalidArgumentError, match=match):
            score_sequences(model, **kwargs)
    with pytest.raises(InvalidArgumentError, match="takes no images"):
        score_sequences(make_invariant(load_model(tiny_checkpoint, torch.float32)), [sequence],
                        processor=image_processor)


def image_rows(tmp_path, images, tokenizer) -> list[dict]:
    """Lines with images as data: URLs and files beside the input, with text and ids, and bad ones."""
    Image.fromarray(images[1]).save(tmp_path / "second.png")
    pad = "<|vision_start|><|image_pad|><|vision_end|>"
    image_ids = tokenizer.convert_tokens_to_ids(["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"])
    return [
        {"id": "prompt", "prompt": f"the cat {pad} runs", "completion": " to the model",
         "images": [data_url(images[0])]},
        {"id": "ids", "prompt_ids": [5, 6] + image_ids, "completion_ids": [7, 8, 9], "images": ["second.png"]},
        {"id": "two", "text": f"{pad} a dog {pad} the end", "images": [data_url(images[2]), "second.png"]},
        {"id": "text", "text": "the cat runs to the model"},
        {"id": "missing", "input_ids": [5] + image_ids + [6], "images": ["absent.png"]},
        {"id": "undecodable", "input_ids": [5] + image_ids + [6], "images": ["data:image/png;base64,bm90IGFu"]},
        {"id": "count", "input_ids": [5] + image_ids + [6], "images": ["second.png", "second.png"]},
        {"id": "kind", "input_ids": [5] + image_ids + [6], "images": "second.png"},
    ]


def run_score(path, inp, out, *extra) -> int:
    return scoring_cli.main(["--model", str(path), "--input", str(inp), "--output", str(out), "--dtype", "fp32",
                             *extra])


def test_score_command_with_images(checkpoint, tmp_path):
    path, config, image_processor, tokenizer, images = checkpoint
    inp = write_jsonl(tmp_path / "in.jsonl", image_rows(tmp_path, images, tokenizer))
    outputs = {}
    for budget in ("1", "100000"):
        out = tmp_path / f"out-{budget}.jsonl"
        assert run_score(path, inp, out, "--max-batch-tokens", budget) == exit_codes.ROW_ERRORS
        outputs[budget] = out.read_bytes()
    assert outputs["1"] == outputs["100000"]
    rows_out = {r["id"]: r for r in read_rows(tmp_path / "out-1.jsonl")}
    errors = {k: r["error"] for k, r in rows_out.items() if "error" in r}
    assert sorted(errors) == ["count", "kind", "missing", "undecodable"]
    assert "absent.png" in errors["missing"] and "not a decodable image" in errors["undecodable"]
    assert "2 images" in errors["count"] and "non-empty list of strings" in errors["kind"]
    # The same sequences through score_sequences: the same digests.
    pad = "<|vision_start|><|image_pad|><|vision_end|>"
    image_ids = tokenizer.convert_tokens_to_ids(["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"])
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    prompt = encode(f"the cat {pad} runs")
    sequences = [{"prompt_token_ids": prompt + encode(" to the model"), "multi_modal_data": {"image": [images[0]]}},
                 {"prompt_token_ids": [5, 6] + image_ids + [7, 8, 9], "multi_modal_data": {"image": [images[1]]}},
                 {"prompt_token_ids": encode(f"{pad} a dog {pad} the end"),
                  "multi_modal_data": {"image": [images[2], images[1]]}},
                 encode("the cat runs to the model")]
    want = score_sequences(load(path), sequences, prompt_lengths=[len(prompt), 5, 1, 1], processor=image_processor)
    assert [rows_out[k]["digest"] for k in ("prompt", "ids", "two", "text")] == [r.digest for r in want]
    assert rows_out["ids"]["num_tokens"] == 3


@pytest.mark.parametrize("checkpoint", ["qwen2_5_vl"], indirect=True)  # one family is enough here
@pytest.mark.heavy  # starts a local Ray
def test_score_command_with_images_on_ray(checkpoint, tmp_path):
    """--ray: the driver checks each line's images, the worker processes them again from their sources
    (data: URLs, absolute paths); the output file is byte for byte the single-process one."""
    path, _, _, tokenizer, images = checkpoint
    inp = write_jsonl(tmp_path / "in.jsonl", image_rows(tmp_path, images, tokenizer))
    assert run_score(path, inp, tmp_path / "local.jsonl") == exit_codes.ROW_ERRORS
    assert run_score(path, inp, tmp_path / "ray.jsonl", "--ray", "--num-workers", "1",
                     "--rows-per-task", "2") == exit_codes.ROW_ERRORS
    assert (tmp_path / "ray.jsonl").read_bytes() == (tmp_path / "local.jsonl").read_bytes()


@pytest.mark.parametrize("checkpoint", ["qwen2_5_vl"], indirect=True)  # one family is enough here
@pytest.mark.heavy
def test_score_command_refuses_what_it_does_not_run_with_images(checkpoint, tmp_path, capsys):
    path = checkpoint[0]
    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "input_ids": [5, 6, 7]}])
    for extra, match in ((["--lora", f"a={tmp_path}"], "LoRA adapters on vision-language models"),
                         (["--tensor-parallel-size", "2"], "tensor parallelism")):
        code = scoring_cli.main(["--model", str(path), "--input", str(inp), "--output", str(tmp_path / "out.jsonl"),
                                 "--dtype", "fp32", *extra])
        assert code == exit_codes.REFUSED
        assert match in capsys.readouterr().err
