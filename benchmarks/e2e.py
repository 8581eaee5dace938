"""End to end: one random-init model of the preset (default Qwen2.5-1.5B; quick: the family's
``tiny`` preset): scoring tokens/s, decode tokens/s and peak memory on the same weights, each item
stock (HF "sdpa", no patch) and then invariant (``make_invariant``, then ``restore``) back to back,
so that both modes of an item see the same machine state (clocks, temperature, other load)."""
from __future__ import annotations

import contextlib

import torch
from tqdm import tqdm

from invariant_infer import make_invariant, restore
from invariant_infer.testing.random_checkpoints import random_config, random_model

from .matmul import DEFAULT_FAMILY, DEFAULT_PRESET
from .timing import Run, free_memory, peak_gb, reset_peak, time_ms

SCORE_SHAPES, QUICK_SCORE_SHAPES = ((1, 512), (8, 512), (32, 512), (8, 2048)), ((1, 16), (4, 16))
HEADLINE_SCORE, QUICK_HEADLINE_SCORE = ((1, 512), (8, 2048)), ((4, 16),)
# (batch, prompt length, new tokens)
DECODE_SHAPES, QUICK_DECODE_SHAPES = ((1, 128, 32), (8, 128, 32), (32, 128, 32)), ((1, 8, 4), (2, 8, 4))
HEADLINE_DECODE, QUICK_HEADLINE_DECODE = ((1, 128, 32), (32, 128, 32)), ((2, 8, 4),)
MODES = ("stock", "invariant")


def preset_config(family: str, preset: str, config=None, **overrides):
    """(config, name): ``config`` itself when given (named "<model_type>:custom"), else the preset's
    config with ``overrides`` (named "family:preset")."""
    if config is not None:
        return config, f"{config.model_type}:custom"
    return random_config(family, preset, **overrides), f"{family}:{preset}"


def build_model(ctx: Run, config, dtype=torch.bfloat16):
    """Random weights created directly on the device (no 6 GB fp32 detour through the host)."""
    with torch.device(ctx.device):
        model = random_model(config, seed=0, dtype=dtype)
    model.set_attn_implementation("sdpa")
    return model


def _generate(model, ids, new_tokens):
    return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)


@contextlib.contextmanager
def _mode(model, mode: str):
    """The model as it runs in ``mode``: unpatched (stock), or patched for the block's duration."""
    if mode == "stock":
        yield model
        return
    make_invariant(model)
    try:
        yield model
    finally:
        restore(model)


def _score(ctx: Run, model, mode: str, batch: int, seq: int, ids, rows: dict) -> None:
    if ctx.out_of_time(f"e2e {mode} {batch}x{seq}"):
        return
    try:
        mask = torch.ones_like(ids)
        fn = lambda: model(input_ids=ids, attention_mask=mask).logits  # noqa: E731
        reset_peak(ctx.device)
        logits = fn()  # warm-up (compiles kernels) and the peak-memory pass
        peak = peak_gb(ctx.device)
        last = logits[:, -1].float().cpu()
        del logits
        reps = (5 if batch * seq <= 8192 else 3) if ctx.on_gpu else 1
        ms = time_ms(fn, ctx.device, reps=reps, warmup=0)
        row = rows.setdefault((batch, seq), {"batch": batch, "seq": seq})
        row.update({f"{mode}_ms": ms, f"{mode}_tokens_per_s": batch * seq / (ms * 1e-3), f"{mode}_peak_gb": peak})
        row[f"_{mode}_last"] = last
    except Exception as exc:
        ctx.failed(f"e2e {mode} {batch}x{seq}", exc)


def _decode(ctx: Run, model, mode: str, batch: int, prompt: int, new: int, ids, decode_rows: dict) -> None:
    if ctx.out_of_time(f"decode {mode} {batch}x{prompt}+{new}"):
        return
    try:
        _generate(model, ids, new)  # warm-up
        prefill_ms = time_ms(lambda: _generate(model, ids, 1), ctx.device, reps=3 if ctx.on_gpu else 1, warmup=0)
        full_ms = time_ms(lambda: _generate(model, ids, new), ctx.device, reps=3 if ctx.on_gpu else 1, warmup=0)
        decode_s = max(full_ms - prefill_ms, 1e-6) * 1e-3  # new - 1 decode steps
        row = decode_rows.setdefault((batch, prompt, new), {"batch": batch, "prompt": prompt, "new_tokens": new})
        row.update({f"{mode}_prefill_ms": prefill_ms, f"{mode}_generate_ms": full_ms,
                    f"{mode}_decode_tokens_per_s": batch * (new - 1) / decode_s})
    except Exception as exc:
        ctx.failed(f"decode {mode} {batch}x{prompt}+{new}", exc)


def run(ctx: Run, config=None, score_shapes=None, decode_shapes=None, dtype=torch.bfloat16,
        family: str = DEFAULT_FAMILY, preset: str = DEFAULT_PRESET) -> dict:
    config, name = preset_config(family, "tiny" if ctx.quick else preset, config)
    score_shapes = score_shapes or ctx.grid(SCORE_SHAPES, QUICK_SCORE_SHAPES, HEADLINE_SCORE, QUICK_HEADLINE_SCORE)
    decode_shapes = decode_shapes or ctx.grid(DECODE_SHAPES, QUICK_DECODE_SHAPES, HEADLINE_DECODE,
                                              QUICK_HEADLINE_DECODE)
    model = build_model(ctx, config, dtype)
    gen = torch.Generator(device=ctx.device).manual_seed(3)
    randint = lambda b, s: torch.randint(0, config.vocab_size, (b, s), generator=gen, device=ctx.device)  # noqa: E731
    inputs = {"score": {(b, s): randint(b, s) for b, s in score_shapes},
              "decode": {(b, p, n): randint(b, p) for b, p, n in decode_shapes}}
    rows, decode_rows = {}, {}
    with torch.inference_mode():  # per item: stock, then invariant, back to back
        for (batch, seq), ids in tqdm(inputs["score"].items(), desc="e2e", leave=False):
            for mode in MODES:
                with _mode(model, mode):
                    _score(ctx, model, mode, batch, seq, ids, rows)
        for (batch, prompt, new), ids in tqdm(inputs["decode"].items(), desc="decode", leave=False):
            for mode in MODES:
                with _mode(model, mode):
                    _decode(ctx, model, mode, batch, prompt, new, ids, decode_rows)
    model_info = {"preset": name, "layers": config.num_hidden_layers, "hidden": config.hidden_size,
                  "intermediate": config.intermediate_size, "vocab": config.vocab_size, "dtype": str(dtype)[6:],
                  "params_m": sum(p.numel() for p in model.parameters()) / 1e6}
    del model
    free_memory(ctx.device)
    out = []
    for row in rows.values():
        stock, inv = row.pop("_stock_last", None), row.pop("_invariant_last", None)
        if "stock_ms" in row and "invariant_ms" in row:
            row["ratio"] = row["invariant_ms"] / row["stock_ms"]
        row["last_token_max_abs_diff"] = (inv - stock).abs().max().item() if stock is not None and inv is not None else None
        row.update(model_info)
        for key in ("stock_tokens_per_s", "invariant_tokens_per_s", "stock_peak_gb", "invariant_peak_gb"):
            row.setdefault(key, None)
        out.append(row)
    decode = list(decode_rows.values())
    for row in decode:
        if "stock_decode_tokens_per_s" in row and "invariant_decode_tokens_per_s" in row:
            row["ratio"] = row["stock_decode_tokens_per_s"] / row["invariant_decode_tokens_per_s"]
        row.update(model_info)
    return {"e2e": out, "decode": decode}
