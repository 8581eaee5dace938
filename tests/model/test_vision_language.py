"""Qwen2.5-VL and Qwen3-VL, loaded with ``AutoModelForImageTextToText`` from saved random checkpoints,
images made by transformers' own image processor. Each image's features are bitwise those of the
image alone, in any company and order; each row's logits (one image, two images, text only) are
bitwise alone in any padded batch; the ``inputs_embeds`` paths (merged features with
``get_rope_index`` positions, Qwen3-VL's deepstack features beside them; transformers' own, with
``mm_encoder_outputs``) give the ``input_ids`` path's bits, and a text-only ``inputs_embeds`` call
after an image call is not shifted by the image call's rope deltas; ``generate`` with images gives
each row's tokens and logits alone, greedy and seeded, and each greedy step equals one forward over
the sequence. fp32 is within tolerance of stock float64, which references without Qwen2.5-VL's
windows or Qwen3-VL's deepstack, or without the multimodal positions, miss.
Negative controls: an M-dependent GEMM (rows), a segment-count-dependent attention block (images).
Videos, training the tower and Qwen2-VL are refused by name; tensor parallelism refuses
vision-language models by name (the engine's, the server's, scoring's and training's tests are in
tests/engine, tests/server, tests/scoring and tests/training)."""
from __future__ import annotations

import copy
import functools
import inspect

import numpy as np
import pytest
import torch
from transformers import AutoModelForImageTextToText, Qwen2VLConfig

import invariant_infer.model.layer_forwards
from helpers.controls import m_dependent_linear
from invariant_infer import NonInvariantInputError, UnsupportedModelError, make_invariant
from invariant_infer.generation.generate import seeded_sampling
from invariant_infer.kernels import AttentionConfig, attention
from invariant_infer.model import vision as vision_module
from invariant_infer.model.padding import pad_sequences
from invariant_infer.testing.random_checkpoints import random_config, save_random_checkpoint

FAMILIES = ("qwen2_5_vl", "qwen3_vl")
IMAGE, START, END = 500, 502, 503  # the tiny presets' image, vision-start and vision-end token ids
# Images of 8 x 6, 4 x 10 and 6 x 4 patches (12, 10 and 6 merged tokens): Qwen2.5-VL's windows of
# 4 x 4 patches cut at the edges; Qwen3-VL's 4 x 4 position grid sampled up and down.
IMAGE_GRIDS = ((8, 6), (4, 10), (6, 4))
# Rows: (text before, images, text after); two images in one row, and a text-only row.
ROWS = (([5, 6, 7], [0], [8, 9]), ([11], [1, 2], [12, 13, 14, 15]), ([20, 21, 22, 23, 24, 30, 31], [], [25]))
FP32_TOLERANCE = 1e-5  # max |logit - stock float64's|


def cells(fast: str) -> list:
    """Both families, the one other than ``fast`` in the heavy tier (CI time; the model-level contracts
    run on both in the fast tier)."""
    return [pytest.param(f, marks=() if f == fast else pytest.mark.heavy) for f in FAMILIES]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("vision_language")
    return {family: save_random_checkpoint(root / family, random_config(family, "tiny"), seed=1)
            for family in FAMILIES}


def load(path, dtype):
    return AutoModelForImageTextToText.from_pretrained(path, dtype=dtype).eval()


def make_images(patch: int):
    """(pixel_values [patches, 3 * 2 * patch^2], image_grid_thw [1, 3]) of each image, from transformers'
    image processor; processing them together gives the concatenation of each alone, which the tests build."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    side = 2 * patch  # a merged token
    processor = Qwen2VLImageProcessorPil(patch_size=patch, merge_size=2, min_pixels=side * side,
                                         max_pixels=side * side * 64)
    rng = np.random.default_rng(0)
    arrays = [rng.integers(0, 256, (h * patch, w * patch, 3), dtype=np.uint8) for h, w in IMAGE_GRIDS]
    alone = [processor(images=[a], return_tensors="pt") for a in arrays]
    together = processor(images=arrays, return_tensors="pt")
    assert torch.equal(together["pixel_values"], torch.cat([a["pixel_values"] for a in alone]))
    assert together["image_grid_thw"].tolist() == [[1, h, w] for h, w in IMAGE_GRIDS]
    return [(a["pixel_values"], a["image_grid_thw"]) for a in alone]


@pytest.fixture(scope="module")
def images():
    return {family: make_images(random_config(family, "tiny").vision_config.patch_size) for family in FAMILIES}


def row_ids(row, images) -> list[int]:
    before, used, after = row
    ids = list(before)
    for index in used:
        ids += [START] + [IMAGE] * (int(images[index][1].prod()) // 4) + [END]
    return ids + list(after)


def batch_inputs(rows, images, side="left", extra_pad=0) -> dict:
    sequences = [row_ids(row, images) for row in rows]
    ids, mask = pad_sequences(sequences, side=side, width=max(map(len, sequences)) + extra_pad)
    used = [index for row in rows for index in row[1]]
    inputs = dict(input_ids=ids, attention_mask=mask)
    if used:
        inputs.update(pixel_values=torch.cat([images[i][0] for i in used]),
                      image_grid_thw=torch.cat([images[i][1] for i in used]),
                      mm_token_type_ids=(ids == IMAGE).to(torch.int32))
    return inputs


def real_logits(model, inputs) -> list[torch.Tensor]:
    with torch.no_grad():
        logits = model(**inputs).logits
    return [row[mask.bool()] for row, mask in zip(logits, inputs["attention_mask"])]


def rows_mismatching_alone(model, images, batchings) -> list:
    alone = [real_logits(model, batch_inputs([row], images))[0] for row in ROWS]
    found = []
    for order, side, extra_pad in batchings:
        got = real_logits(model, batch_inputs([ROWS[i] for i in order], images, side, extra_pad))
        found += [(order, side, i) for i, logits in zip(order, got) if not torch.equal(logits, alone[i])]
    return found


BATCHINGS = (((0, 1, 2), "left", 0), ((2, 1, 0), "right", 3), ((1, 0), "left", 2))


def image_features(model, images, order) -> list[torch.Tensor]:
    with torch.no_grad():
        merged = model.model.visual(torch.cat([images[i][0] for i in order]),
                                    grid_thw=torch.cat([images[i][1] for i in order])).pooler_output
    sizes = [int(images[i][1].prod()) // 4 for i in order]
    return dict(zip(order, merged.split(sizes)))


def features_mismatching_alone(model, images) -> list:
    alone = {i: image_features(model, images, [i])[i] for i in range(len(images))}
    found = []
    for order in ((0, 1, 2), (2, 1, 0), (1, 2)):
        found += [(order, i) for i, f in image_features(model, images, order).items() if not torch.equal(f, alone[i])]
    return found


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, pytest.param(torch.float32, marks=pytest.mark.heavy)])
def test_image_features_equal_alone_in_any_company_and_order(checkpoints, images, family, dtype):
    model = make_invariant(load(checkpoints[family], dtype))
    assert features_mismatching_alone(model, images[family]) == []


@pytest.mark.parametrize("family", cells("qwen3_vl"))
def test_negative_control_a_segment_count_dependent_attention_block(checkpoints, images, family, monkeypatch):
    def attention_by_segments(q, k, v, kv_start, kv_end, q_start, scale, **kwargs):
        block_n = 16 if q.shape[0] == 1 else 64  # an image alone is one segment in a full-attention block
        return attention(q, k, v, kv_start, kv_end, q_start, scale, config=AttentionConfig(32, block_n), **kwargs)
    model = make_invariant(load(checkpoints[family], torch.float32))  # bf16 rounding can hide a reordered sum
    monkeypatch.setattr(vision_module, "attention", attention_by_segments)
    assert features_mismatching_alone(model, images[family]) != []


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, pytest.param(torch.float32, marks=pytest.mark.heavy),
                                   pytest.param(torch.float16, marks=pytest.mark.heavy)])
def test_rows_equal_alone_in_any_padded_batch(checkpoints, images, family, dtype):
    model = make_invariant(load(checkpoints[family], dtype))
    assert rows_mismatching_alone(model, images[family], BATCHINGS) == []


@pytest.mark.parametrize("family", cells("qwen2_5_vl"))
def test_negative_control_an_m_dependent_gemm(checkpoints, images, family, monkeypatch):
    model = make_invariant(load(checkpoints[family], torch.float32))
    # BLOCK_K by M: a row alone has at most 34 tokens, a batch of them more.
    monkeypatch.setattr(invariant_infer.model.layer_forwards, "linear",
                        functools.partial(m_dependent_linear, small_m=40))
    assert rows_mismatching_alone(model, images[family], BATCHINGS[:1]) != []


@pytest.mark.parametrize("family", FAMILIES)
def test_inputs_embeds_path_equals_input_ids_path(checkpoints, images, family):
    """Merged features as inputs_embeds (through the language model with Qwen3-VL's deepstack features,
    as the multimodal model hands them over), and transformers' own inputs_embeds path (placeholders
    in the embeddings, the encoder's outputs beside them) where this transformers has it."""
    model = make_invariant(load(checkpoints[family], torch.bfloat16))
    inputs = batch_inputs(ROWS, images[family])
    want = real_logits(model, inputs)
    mask = inputs["attention_mask"]
    with torch.no_grad():
        encoded = model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
        placeholders = model.model.get_input_embeddings()(inputs["input_ids"])
        image_positions = inputs["input_ids"] == IMAGE
        merged = placeholders.masked_scatter(image_positions[..., None], torch.cat(encoded.pooler_output))
        positions, _ = model.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                                  inputs["image_grid_thw"], attention_mask=mask)
        deepstack = getattr(encoded, "deepstack_features", None)
        if deepstack is None:
            got = real_logits(model, dict(inputs_embeds=merged, attention_mask=mask, position_ids=positions))
        else:
            deepstack = [torch.cat(f) if isinstance(f, (list, tuple)) else f for f in deepstack]
            hidden = model.model.language_model(inputs_embeds=merged, attention_mask=mask, position_ids=positions,
                                                visual_pos_masks=image_positions,
                                                deepstack_visual_embeds=deepstack).last_hidden_state
            got = [row[m.bool()] for row, m in zip(model.lm_head(hidden), mask)]
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    if "mm_encoder_outputs" in inspect.signature(type(model.model).forward).parameters:  # transformers 5.24 on
        got = real_logits(model, dict(inputs_embeds=placeholders, attention_mask=mask, position_ids=positions,
                                      mm_encoder_outputs={"image": encoded}))
        assert all(torch.equal(g, w) for g, w in zip(got, want))
    # A text-only inputs_embeds call right after the image call: text positions, not the image call's deltas.
    text = batch_inputs([ROWS[2], ROWS[2]], images[family])
    with torch.no_grad():
        text_embeds = model.model.get_input_embeddings()(text["input_ids"])
    got = real_logits(model, dict(inputs_embeds=text_embeds, attention_mask=text["attention_mask"]))
    assert torch.equal(got[0], want[2])


@pytest.mark.parametrize("family", FAMILIES)
def test_accuracy_against_float64_and_what_its_tolerance_catches(checkpoints, images, family):
    stock = load(checkpoints[family], torch.float32)
    model = make_invariant(copy.deepcopy(stock))
    inputs = batch_inputs(ROWS, images[family])
    got = real_logits(model, inputs)

    def error(change=None):
        reference = copy.deepcopy(stock).double()
        if change:
            change(reference)
        want = real_logits(reference, {k: v.double() if v.is_floating_point() else v for k, v in inputs.items()})
        return max((g.double() - w).abs().max().item() for g, w in zip(got, want))

    def without_windows_or_deepstack(reference):
        visual = reference.model.visual
        if family == "qwen2_5_vl":  # every vision block attends over whole images
            visual.fullatt_block_indexes = list(range(len(visual.blocks)))
        else:  # no early-block features added to the decoder layers
            visual.deepstack_visual_indexes = []

    def text_positions(reference):  # every frequency rotates by the temporal position, as text tokens do
        reference.model.language_model.rotary_emb.mrope_section = [8, 0, 0]
    assert error() < FP32_TOLERANCE
    assert error(without_windows_or_deepstack) > 10 * FP32_TOLERANCE
    assert error(text_positions) > 10 * FP32_TOLERANCE


def generated(model, rows, images, new_tokens=5, seeds=None):
    inputs = batch_inputs(rows, images)
    options = dict(max_new_tokens=new_tokens, do_sample=False, output_logits=True, return_dict_in_generate=True,
                   pad_token_id=0)
    if seeds is not None:
        options["logits_processor"] = seeded_sampling(seeds, temperature=0.9, top_k=50)
    out = model.generate(**inputs, **options)
    width = inputs["input_ids"].shape[1]
    return [(out.sequences[b, width:], [step[b] for step in out.logits]) for b in range(len(rows))]


@pytest.mark.parametrize("family, seeded", [("qwen2_5_vl", False), ("qwen3_vl", True),
                                            pytest.param("qwen3_vl", False, marks=pytest.mark.heavy),
                                            pytest.param("qwen2_5_vl", True, marks=pytest.mark.heavy)],
                         ids=["qwen2_5_vl-greedy", "qwen3_vl-seeded", "qwen3_vl-greedy", "qwen2_5_vl-seeded"])
def test_generate_with_images_equals_alone_and_each_step_one_forward(checkpoints, images, family, seeded):
    model, images = make_invariant(load(checkpoints[family], torch.bfloat16)), images[family]
    seeds = [11, 12, 13] if seeded else None
    batch = generated(model, ROWS, images, seeds=seeds)
    for b, row in enumerate(ROWS):
        tokens, logits = generated(model, [row], images, seeds=None if seeds is None else [seeds[b]])[0]
        assert torch.equal(batch[b][0], tokens)
        assert all(torch.equal(x, y) for x, y in zip(batch[b][1], logits))
        sequence = batch_inputs([row], images)
        prompt = sequence["input_ids"].shape[1]
        sequence["input_ids"] = torch.cat([sequence["input_ids"], tokens[None]], dim=1)
        sequence["attention_mask"] = torch.ones_like(sequence["input_ids"])
        sequence.pop("mm_token_type_ids", None)  # derived from the image token id when absent
        with torch.no_grad():
            forward = model(**sequence).logits[0]
        if not seeded:  # seeded scores are the sampler's, not the model's logits
            assert all(torch.equal(forward[prompt - 1 + step], logits[step]) for step in range(len(logits)))


@pytest.mark.parametrize("family", cells("qwen3_vl"))
def test_videos_and_training_the_tower_are_refused(checkpoints, images, family):
    model = make_invariant(load(checkpoints[family], torch.float32))
    inputs = batch_inputs(ROWS[:1], images[family])
    with pytest.raises(NonInvariantInputError, match="videos"):
        model(input_ids=inputs["input_ids"], pixel_values_videos=inputs["pixel_values"],
              video_grid_thw=inputs["image_grid_thw"])
    with pytest.raises(NonInvariantInputError, match="vision tower"):
        model(**inputs)  # parameters require grad, grad enabled


def test_qwen2_vl_is_refused_by_name():
    config = Qwen2VLConfig(text_config=dict(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                            num_key_value_heads=2, num_hidden_layers=1, vocab_size=512),
                           vision_config=dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2))
    with pytest.raises(UnsupportedModelError, match="qwen2_vl"):
        make_invariant(AutoModelForImageTextToText.from_config(config))


@pytest.mark.parametrize("family", cells("qwen2_5_vl"))
def test_tensor_parallelism_refuses_it_by_name(checkpoints, family):
    from invariant_infer.parallel.loading import check_tensor_parallel_size
    with pytest.raises(UnsupportedModelError, match=f"{family}: .* vision-language models"):
        check_tensor_parallel_size(checkpoints[family], 2, torch.device("cpu"))


@pytest.mark.parametrize("family", cells("qwen3_vl"))
def test_the_base_model_from_automodel_equals_the_full_model(checkpoints, images, family):
    from transformers import AutoModel
    model = make_invariant(load(checkpoints[family], torch.bfloat16))
    base = make_invariant(AutoModel.from_pretrained(checkpoints[family], dtype=torch.bfloat16).eval())
    inputs = batch_inputs(ROWS, images[family])
    with torch.no_grad():
        want = model.model(**inputs).last_hidden_state
        assert torch.equal(base(**inputs).last_hidden_state, want)
