"""Vision-language models (Qwen2.5-VL): the vision tower and image + text prefill, invariant vs stock.

Model: Qwen2.5-VL-3B's widths (vision 1280 wide, 16 heads of 80, windows of 112 pixels; language model
2048 wide) cut to ``VISION_DEPTH`` vision blocks (every fourth one over whole images, as released) and
``TEXT_LAYERS`` decoder layers, random weights; quick: the family's ``tiny`` preset. Stock runs
transformers' "sdpa" attention; then ``make_invariant``, then ``restore``. Pixels are random patches
(the tower's input after the image processor). Cases:
  * ``tower``: ``images`` images of ``SIDE`` x ``SIDE`` pixels through ``model.model.visual``;
  * ``prefill``: ``batch`` left-padded rows, each one image and ``TEXT_TOKENS`` text tokens (the last
    row shorter by half its text), through the model.
Each row: ms, the invariant / stock time ratio (above 1: invariant slower), whether image 0's features
(tower) or row 0's logits (prefill) alone equal those in the call, bitwise, for each implementation, and
the max |invariant - stock|.
"""
from __future__ import annotations

import copy

import torch
from tqdm import tqdm

from invariant_infer import make_invariant, restore
from invariant_infer.model.families import FAMILIES
from invariant_infer.testing.random_checkpoints import random_config, random_model

from .timing import Run, free_memory, time_ms

FAMILY, PRESET = "qwen2_5_vl", "qwen2.5-vl-3b"
VISION_DEPTH, TEXT_LAYERS = 8, 4
IMAGES, QUICK_IMAGES = (1, 8), (1, 3)
PREFILL, QUICK_PREFILL = (1, 8), (1, 3)
SIDE, QUICK_SIDE = 448, 112  # pixels: 32 x 32 patches of 14 (quick: 8 x 8)
TEXT_TOKENS, QUICK_TEXT_TOKENS = 64, 8


def model_config(quick: bool):
    """The section's config (see the module docstring)."""
    if quick:
        return random_config(FAMILY, "tiny")
    preset = copy.deepcopy(FAMILIES[FAMILY].presets[PRESET])
    preset["vision_config"].update(depth=VISION_DEPTH, fullatt_block_indexes=list(range(3, VISION_DEPTH, 4)))
    preset["text_config"].update(num_hidden_layers=TEXT_LAYERS)
    return FAMILIES[FAMILY].config_class(**preset)


def _inputs(config, device, images: int, side: int, batch: int, text_tokens: int, gen: torch.Generator) -> dict:
    vision = config.vision_config
    grid = side // vision.patch_size
    patches = torch.randn(images * grid * grid, 3 * vision.temporal_patch_size * vision.patch_size ** 2,
                          generator=gen).to(device)
    image_tokens = grid * grid // vision.spatial_merge_size ** 2
    rows = []
    for b in range(batch):
        text = torch.randint(10, 400, (text_tokens if b < batch - 1 or batch == 1 else text_tokens // 2,),
                             generator=gen).tolist()
        rows.append(text[:2] + [config.vision_start_token_id] + [config.image_token_id] * image_tokens +
                    [config.vision_end_token_id] + text[2:])
    width = max(map(len, rows))
    ids = torch.zeros(batch, width, dtype=torch.long)
    mask = torch.zeros(batch, width, dtype=torch.long)
    for b, row in enumerate(rows):
        ids[b, width - len(row):], mask[b, width - len(row):] = torch.tensor(row), 1
    return {"patches": patches, "grid": torch.tensor([[1, grid, grid]] * images, device=device),
            "prefill": dict(input_ids=ids.to(device), attention_mask=mask.to(device),
                            pixel_values=patches[:batch * grid * grid],
                            image_grid_thw=torch.tensor([[1, grid, grid]] * batch, device=device),
                            mm_token_type_ids=(ids == config.image_token_id).to(device, torch.int32)),
            "row0": dict(input_ids=ids[:1, width - len(rows[0]):].to(device),
                         attention_mask=mask[:1, width - len(rows[0]):].to(device),
                         pixel_values=patches[:grid * grid], image_grid_thw=torch.tensor([[1, grid, grid]], device=device),
                         mm_token_type_ids=(ids[:1, width - len(rows[0]):] == config.image_token_id).to(device,
                                                                                                        torch.int32)),
            "image_tokens": image_tokens}


def _measure(ctx: Run, model, mode: str, cases: dict, rows: dict) -> None:
    reps = 5 if ctx.on_gpu else 1
    for key, inputs in tqdm(cases.items(), desc=f"vlm {mode}", leave=False):
        case, count = key
        if ctx.out_of_time(f"vlm {mode} {case} {count}"):
            continue
        try:
            if case == "tower":
                tokens = inputs["image_tokens"]

                def run(n=count):
                    grid = inputs["grid"][:n]
                    return model.model.visual(inputs["patches"][:int(grid.prod(-1).sum())], grid_thw=grid).pooler_output
                out = run()
                alone = run(1)
                equal = torch.equal(alone, out[:tokens])
                ms = time_ms(run, ctx.device, reps=reps, warmup=0)
                kept = out.float().cpu()
            else:
                def run():
                    return model(**inputs["prefill"]).logits
                out = run()
                n = inputs["row0"]["input_ids"].shape[1]
                equal = torch.equal(model(**inputs["row0"]).logits[0], out[0, -n:])
                ms = time_ms(run, ctx.device, reps=reps, warmup=0)
                kept = out[:, -1].float().cpu()
            row = rows.setdefault(key, {"case": case, "images" if case == "tower" else "batch": count})
            row.update({f"{mode}_ms": ms, f"{mode}_alone_bitwise_equal": equal, f"_{mode}_out": kept})
        except Exception as exc:
            ctx.failed(f"vlm {mode} {case} {count}", exc)


def run(ctx: Run, family: str | None = None, preset: str | None = None, dtype=torch.bfloat16) -> dict:
    config = model_config(ctx.quick)
    with torch.device(ctx.device):
        model = random_model(config, seed=0, dtype=dtype)
    model.set_attn_implementation("sdpa")
    gen = torch.Generator().manual_seed(5)
    side, text = (QUICK_SIDE, QUICK_TEXT_TOKENS) if ctx.quick else (SIDE, TEXT_TOKENS)
    images, batches = (QUICK_IMAGES, QUICK_PREFILL) if ctx.quick else (IMAGES, PREFILL)
    cases = {("tower", n): _inputs(config, ctx.device, n, side, 1, text, gen) for n in images}
    cases.update({("prefill", b): _inputs(config, ctx.device, b, side, b, text, gen) for b in batches})
    rows: dict = {}
    with torch.inference_mode():
        _measure(ctx, model, "stock", cases, rows)
        make_invariant(model)
        try:
            _measure(ctx, model, "invariant", cases, rows)
        finally:
            restore(model)
    del model
    free_memory(ctx.device)
    out = []
    for key, row in rows.items():
        stock, invariant = row.pop("_stock_out", None), row.pop("_invariant_out", None)
        row["max_abs_diff_to_stock"] = (invariant - stock).abs().max().item() \
            if stock is not None and invariant is not None else None
        row["ratio"] = row["invariant_ms"] / row["stock_ms"] if "invariant_ms" in row and "stock_ms" in row else None
        row.update({"preset": "tiny" if ctx.quick else PRESET, "side": side, "image_tokens": cases[key]["image_tokens"],
                    "dtype": str(dtype)[6:]})
        for field in ("stock_ms", "invariant_ms", "stock_alone_bitwise_equal", "invariant_alone_bitwise_equal",
                      "images", "batch"):
            row.setdefault(field, None)
        out.append(row)
    return {"vlm": out}


def markdown(results: dict, table) -> str:
    """RESULTS.md's table of this section (``table``: report_markdown's, which calls this)."""
    if not results.get("vlm"):
        return ""
    out = ["\n## Vision-language models (Qwen2.5-VL): vision tower and image + text prefill, invariant vs stock\n\n"
           "ratio = invariant ms / stock ms (above 1 = invariant slower); alone bitwise: image 0's features (tower) or "
           "row 0's logits (prefill) alone vs in the call (`torch.equal`).\n"]
    out.append(table(results["vlm"], [
        ("case", "case"), ("images", "images"), ("batch", "batch"), ("pixels", "side"), ("tokens / image", "image_tokens"),
        ("stock ms", "stock_ms"), ("invariant ms", "invariant_ms"), ("ratio", "ratio"),
        ("alone bitwise (invariant)", "invariant_alone_bitwise_equal"),
        ("alone bitwise (stock)", "stock_alone_bitwise_equal"), ("max abs Δ to stock", "max_abs_diff_to_stock")]))
    return "\n".join(out)
