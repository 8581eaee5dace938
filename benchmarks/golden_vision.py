"""Golden digests of the vision-language families (Qwen2.5-VL, Qwen3-VL), part of
``benchmarks.golden_digests``: a model of one decoder layer and two vision blocks whose weights,
pixel values and token ids all come from the golden formula, written with ``save_pretrained`` and read
back with ``AutoModelForImageTextToText``.

Per family and dtype: ``features`` (each image encoded alone), ``features_together`` (all images in one
call, in reverse order), ``alone`` (each row's logits, its images with it), ``left_pad`` and
``right_pad`` (the rows in padded batches). Rows: one image, two images of other sizes, text only,
and an image at the start.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch
from transformers import AutoModelForImageTextToText

from benchmarks.golden_formula import digest, integers, parameter_values
from invariant_infer.model.families import FAMILIES
from invariant_infer.model.padding import pad_sequences
from invariant_infer.model.patch import make_invariant

_TEXT = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1,
             vocab_size=256, max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1,
             eos_token_id=2)
_TOKENS = dict(image_token_id=250, video_token_id=251, vision_start_token_id=252, vision_end_token_id=253,
               tie_word_embeddings=False)
_VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, spatial_merge_size=2,
               temporal_patch_size=2, in_channels=3)
# Every field that shapes the arithmetic is written out, as in golden_digests.CONFIGS.
VISION_CONFIGS = {
    # Head dim 16: mrope sections 2 + 3 + 3 of its 8 frequencies. Window blocks over 2 x 2 merged units,
    # the second block over whole images.
    "qwen2_5_vl": dict(
        text_config=dict(_TEXT, use_sliding_window=False,
                         rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3])),
        vision_config=dict(_VISION, patch_size=14, window_size=56, fullatt_block_indexes=[1], hidden_act="silu"),
        **_TOKENS),
    # Interleaved sections; a 4 x 4 position grid sampled bilinearly; deepstack from the first block.
    "qwen3_vl": dict(
        text_config=dict(_TEXT, head_dim=16, attention_bias=False,
                         rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3],
                                              mrope_interleaved=True)),
        vision_config=dict(_VISION, patch_size=16, num_position_embeddings=16, deepstack_visual_indexes=[0],
                           hidden_act="gelu_pytorch_tanh"),
        **_TOKENS),
}
GRIDS = ((1, 4, 6), (1, 2, 4), (1, 6, 2))  # (t, h, w) patches of the three images
# Per row: (text before, images, text between / after); None marks where an image goes.
ROWS = (((3, None, 4), (0,)), ((2, None, 1, None, 2), (1, 2)), ((5,), ()), ((None, 2), (1,)))
BATCHINGS = {"left_pad": ((0, 1, 2, 3), "left", 2), "right_pad": ((3, 2, 1, 0), "right", 1)}


def write_checkpoint(family: str, dtype: torch.dtype, path: Path) -> Path:
    config = FAMILIES[family].config_class(**VISION_CONFIGS[family])
    model = AutoModelForImageTextToText.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            shape = tuple(param.shape)
            if len(shape) == 5:  # the Conv3d patch embedding: a matrix over flattened patches
                shape = (shape[0], math.prod(shape[1:]))
            param.copy_(parameter_values(name, shape).reshape(param.shape))
    model.to(dtype).save_pretrained(path)
    return path


def inputs(family: str) -> tuple[list[torch.Tensor], list[list[int]], list[list[int]]]:
    """(pixel values per image, grids per image, token ids per row with each image's tokens expanded)."""
    config = VISION_CONFIGS[family]
    vision = config["vision_config"]
    width = vision["in_channels"] * vision["temporal_patch_size"] * vision["patch_size"] ** 2
    pixels = [torch.from_numpy(integers(f"{family}/pixels{i}", math.prod(g) * width, -127, 128) / 64.0).float()
              .reshape(math.prod(g), width) for i, g in enumerate(GRIDS)]
    merge = vision["spatial_merge_size"] ** 2
    rows = []
    for r, (layout, images) in enumerate(ROWS):
        ids, next_image = [], iter(images)
        for k, part in enumerate(layout):
            if part is None:
                count = math.prod(GRIDS[next(next_image)]) // merge
                ids += [config["vision_start_token_id"]] + [config["image_token_id"]] * count + \
                       [config["vision_end_token_id"]]
            else:
                ids += integers(f"{family}/row{r}/{k}", part, 0, 248).tolist()  # below the vision tokens
        rows.append(ids)
    return pixels, [list(g) for g in GRIDS], rows


def _image_inputs(pixels, grids, images, device, dtype) -> dict:
    if not images:
        return {}
    return {"pixel_values": torch.cat([pixels[i] for i in images]).to(device, dtype),
            "image_grid_thw": torch.tensor([grids[i] for i in images], device=device)}


@torch.no_grad()
def vision_digests(family: str, dtype_name: str, dtype: torch.dtype, device: str, path: Path) -> dict[str, str]:
    """{family/dtype/case: sha256 hex} of the cases in the module's docstring."""
    write_checkpoint(family, dtype, path)
    model = make_invariant(AutoModelForImageTextToText.from_pretrained(path, dtype=dtype).to(device).eval())
    pixels, grids, rows = inputs(family)
    prefix, out = f"{family}/{dtype_name}", {}

    def features(images) -> list[torch.Tensor]:
        encoded = model.model.get_image_features(**_image_inputs(pixels, grids, images, device, dtype))
        per_image = list(encoded.pooler_output)
        sizes = [p.shape[0] for p in per_image]  # deepstack features: per image, or (older transformers) stacked
        deepstack = [list(f) if isinstance(f, (list, tuple)) else list(f.split(sizes))
                     for f in getattr(encoded, "deepstack_features", None) or []]
        return [torch.cat([per_image[k]] + [d[k] for d in deepstack]) for k in range(len(images))]
    out[f"{prefix}/features"] = digest(f for i in range(len(GRIDS)) for f in features([i]))
    together = features(list(range(len(GRIDS)))[::-1])[::-1]
    out[f"{prefix}/features_together"] = digest(together)

    def logits(members, side, extra) -> list[torch.Tensor]:
        samples = [torch.tensor(rows[m]) for m in members]
        width = max(len(s) for s in samples) + extra
        ids, mask = pad_sequences(samples, side=side, width=width, device=device)
        images = [i for m in members for i in ROWS[m][1]]
        got = model(input_ids=ids, attention_mask=mask, **_image_inputs(pixels, grids, images, device, dtype)).logits
        starts = [width - len(s) if side == "left" else 0 for s in samples]
        return [got[b, start:start + len(s)] for b, (start, s) in enumerate(zip(starts, samples))]
    out[f"{prefix}/alone"] = digest(logits([m], "left", 0)[0] for m in range(len(ROWS)))
    for name, (members, side, extra) in BATCHINGS.items():
        by_row = dict(zip(members, logits(members, side, extra)))
        out[f"{prefix}/{name}"] = digest(by_row[m] for m in sorted(by_row))
    return out
