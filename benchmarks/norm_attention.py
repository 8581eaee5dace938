"""RMSNorm (vs the family's own HF RMSNorm class, e.g. Qwen2RMSNorm) and attention (vs torch SDPA,
called as HF's "sdpa" calls it), at a model preset's widths (default Qwen2.5-1.5B). Attention rows
with a sliding window (``window`` > 0: each query sees its last ``window`` keys) give SDPA the
windowed mask transformers builds for such layers. Rows with attention sinks (``sinks``: gpt-oss's
one logit per head, with its 128-key window or none) compare with transformers' eager sink
attention, as gpt-oss runs stock (SDPA has no sink term). The ``attention_vs_stock`` rows time the same kernels (and
``paged_attention``) against the fastest stock kernels importable here: ``benchmarks.attention_vs_stock``."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm import tqdm

from invariant_infer.model.families import FAMILIES
from invariant_infer.kernels import attention, rms_norm
from invariant_infer.testing.random_checkpoints import random_config

from . import attention_vs_stock
from .matmul import DEFAULT_FAMILY, DEFAULT_PRESET, max_abs_diff
from .stock_kernels import device_label
from .timing import Run, time_ms

NORM_MS, QUICK_NORM_MS = (1, 32, 512, 2048, 8192, 32768), (1, 32)
PREFILL_GRID, QUICK_PREFILL_GRID = [(b, s) for b in (1, 8, 32) for s in (512, 2048)], [(1, 16), (3, 48)]
DECODE_GRID = [(b, c) for b in (1, 16) for c in (512, 1024, 2048, 4096, 8192)]
QUICK_DECODE_GRID = [(2, 64), (2, 128)]
# --items headline: prefill alone and batched (RMSNorm, windows and sinks: none); the headline decode
# rows are attention_vs_stock's (8K context, batch 1 and 16, against SDPA and the decode kernels there).
HEADLINE_PREFILL, QUICK_HEADLINE_PREFILL = [(1, 2048), (8, 2048)], [(3, 48)]
HEADLINE_DECODE, QUICK_HEADLINE_DECODE = [], []
# (batch, tokens, window): prefill of 8k with a 1k or 4k window; decode past the window.
WINDOW_PREFILL, QUICK_WINDOW_PREFILL = [(1, 8192, 1024), (1, 8192, 4096)], [(1, 48, 16)]
WINDOW_DECODE, QUICK_WINDOW_DECODE = [(b, 8192, w) for b in (1, 16) for w in (1024, 4096)], [(2, 128, 40)]
# (batch, q tokens, kv tokens, window) with sinks: prefill 4k and decode past 8k, gpt-oss's window or none.
SINK_CASES = [(1, 4096, 4096, 128), (1, 4096, 4096, 0), (16, 1, 8192, 128), (16, 1, 8192, 0)]
QUICK_SINK_CASES = [(1, 48, 48, 16), (2, 1, 128, 0)]


@dataclass(frozen=True)
class Widths:
    """What the section needs of a preset: the RMSNorm (class, hidden size, eps) and the attention
    heads (query heads, KV heads, head_dim)."""
    rms_norm: type
    hidden: int
    eps: float
    heads: tuple


def widths(family: str = DEFAULT_FAMILY, preset: str = DEFAULT_PRESET) -> Widths:
    config = random_config(family, preset)
    hq, hkv = config.num_attention_heads, config.num_key_value_heads or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // hq
    return Widths(FAMILIES[family].rms_norm, config.hidden_size, config.rms_norm_eps, (hq, hkv, head_dim))


def quick_heads(heads: tuple) -> tuple:
    """Quick (CPU interpreter): at most 2 KV heads, at most 2 query heads per KV head, head_dim at
    most 64 (Qwen2.5-1.5B's 12/2/128 -> 4/2/64). RMSNorm keeps the real hidden size (it is cheap)."""
    hq, hkv, d = heads
    kv = min(hkv, 2)
    return (kv * min(hq // hkv, 2), kv, min(d, 64))


def padding_mask(pads, lq: int, lk: int, device, window: int = 0):
    """HF-style bool mask [B, 1, Lq, Lk] (True = attend) for left padding and a sliding window,
    built once per forward as transformers does; None when nothing is padded and there is no
    window. Fully padded query rows attend everywhere (HF's fix for SDPA), so no NaN."""
    if not any(pads) and not window:
        return None
    key_idx = torch.arange(lk, device=device)
    q_idx = torch.arange(lk - lq, lk, device=device)
    pad = torch.tensor(pads, device=device)
    mask = (key_idx[None, None, :] <= q_idx[None, :, None]) & (key_idx[None, None, :] >= pad[:, None, None])
    if window:
        mask &= key_idx[None, None, :] > q_idx[None, :, None] - window
    return (mask | ~mask.any(-1, keepdim=True))[:, None]


def stock_attention(q, k, v, mask):
    """torch SDPA as transformers' sdpa_attention_forward calls it: no mask -> is_causal with
    enable_gqa; a padding mask -> KV heads repeated (enable_gqa with a mask falls back to math)."""
    lq = q.shape[2]
    if mask is None:
        try:
            return F.scaled_dot_product_attention(q, k, v, is_causal=lq > 1, enable_gqa=True)
        except TypeError:  # torch < 2.5
            pass
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=lq > 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _rmsnorm(ctx: Run, dtype, w: Widths) -> list:
    rows = []
    gen = torch.Generator(device=ctx.device).manual_seed(1)
    hidden, eps = w.hidden, w.eps
    module = w.rms_norm(hidden, eps=eps).to(device=ctx.device, dtype=dtype)
    with torch.no_grad():
        module.weight.copy_(1 + 0.1 * torch.randn(hidden, generator=gen, device=ctx.device))
    for m in tqdm(ctx.grid(NORM_MS, QUICK_NORM_MS), desc="rmsnorm", leave=False):
        if ctx.out_of_time(f"rmsnorm M={m}"):
            continue
        try:
            x = torch.randn(m, hidden, generator=gen, device=ctx.device, dtype=dtype)
            stock_fn, inv_fn = (lambda: module(x)), (lambda: rms_norm(x, module.weight, eps))
            with torch.no_grad():
                y_stock, y_inv = stock_fn(), inv_fn()
                stock_ms = time_ms(stock_fn, ctx.device, flush_l2=True)
                inv_ms = time_ms(inv_fn, ctx.device, reps=3 if ctx.on_gpu else 1, warmup=0, flush_l2=True)
            nbytes = 2 * m * hidden * x.element_size() + hidden * x.element_size()
            rows.append({"M": m, "N": hidden, "eps": eps, "stock_class": w.rms_norm.__name__,
                         "device": device_label(ctx.device),
                         "stock_ms": stock_ms, "invariant_ms": inv_ms, "ratio": inv_ms / stock_ms,
                         "stock_gbps": nbytes / (stock_ms * 1e-3) / 1e9, "invariant_gbps": nbytes / (inv_ms * 1e-3) / 1e9,
                         "max_abs_diff": max_abs_diff(y_inv, y_stock), "bitwise_equal_to_stock": bool(torch.equal(y_inv, y_stock))})
        except Exception as exc:
            ctx.failed(f"rmsnorm M={m}", exc)
    return rows


def stock_sink_attention(q, k, v, mask, sinks):
    """transformers' eager attention with sinks (gpt-oss): scores, the sink column, softmax, drop it."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    lq, lk = q.shape[2], k.shape[2]
    if mask is None:
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)[None, None]
    scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.to(scores.dtype).reshape(1, -1, 1, 1).expand(q.shape[0], -1, lq, 1)
    combined = torch.cat([scores, sink], dim=-1)
    probs = torch.softmax(combined - combined.amax(-1, keepdim=True), dim=-1)[..., :-1]
    return probs.to(v.dtype) @ v


def _attention_case(ctx: Run, gen, dtype, heads: tuple, batch: int, lq: int, lk: int, pads: list,
                    window: int = 0, with_sinks: bool = False) -> dict:
    hq, hkv, d = heads
    q = torch.randn(batch, hq, lq, d, generator=gen, device=ctx.device, dtype=dtype)
    k = torch.randn(batch, hkv, lk, d, generator=gen, device=ctx.device, dtype=dtype)
    v = torch.randn(batch, hkv, lk, d, generator=gen, device=ctx.device, dtype=dtype)
    i32 = dict(device=ctx.device, dtype=torch.int32)
    kv_start, kv_end = torch.tensor(pads, **i32), torch.full((batch,), lk, **i32)
    q_start = torch.full((batch,), lk - lq, **i32)  # query i sits at key position lk - lq + i
    scale = d ** -0.5
    mask = padding_mask(pads, lq, lk, ctx.device, window)
    sinks = torch.randn(hq, generator=gen, device=ctx.device, dtype=dtype) if with_sinks else None
    stock_fn = (lambda: stock_sink_attention(q, k, v, mask, sinks)) if with_sinks else \
        (lambda: stock_attention(q, k, v, mask))
    inv_fn = lambda: attention(q, k, v, kv_start, kv_end, q_start, scale, window=window, sinks=sinks)  # noqa: E731
    y_stock, y_inv = stock_fn().transpose(1, 2), inv_fn()
    stock_ms = time_ms(stock_fn, ctx.device, flush_l2=True)
    inv_ms = time_ms(inv_fn, ctx.device, reps=3 if ctx.on_gpu else 1, warmup=0, flush_l2=True)
    real = [slice(max(0, p - (lk - lq)), lq) for p in pads]  # query rows that have a real token
    diff = max((max_abs_diff(y_inv[i, r], y_stock[i, r]) for i, r in enumerate(real) if r.start < r.stop), default=0.0)
    return {"batch": batch, "q_len": lq, "kv_len": lk, "heads": hq, "kv_heads": hkv, "head_dim": d,
            "padded_rows": sum(1 for p in pads if p), "pad_tokens": int(sum(pads)), "window": window,
            "sinks": with_sinks, "device": device_label(ctx.device),
            "stock_ms": stock_ms, "invariant_ms": inv_ms, "ratio": inv_ms / stock_ms, "max_abs_diff": diff}


def _pads(batch: int, seq: int) -> list:
    """Row 0 full length; the others left-padded by different amounts up to a quarter of the row."""
    return [0] + [(37 * i) % (seq // 4 + 1) for i in range(1, batch)]


def run(ctx: Run, dtype=torch.bfloat16, family: str = DEFAULT_FAMILY, preset: str = DEFAULT_PRESET) -> dict:
    w = widths(family, preset)
    heads = quick_heads(w.heads) if ctx.quick else w.heads
    out = {"rmsnorm": _rmsnorm(ctx, dtype, w), "attention": [], "decode_attention": [], attention_vs_stock.KEY: []}
    gen = torch.Generator(device=ctx.device).manual_seed(2)
    with torch.no_grad():
        prefill = ctx.grid(PREFILL_GRID, QUICK_PREFILL_GRID, HEADLINE_PREFILL, QUICK_HEADLINE_PREFILL)
        for batch, seq in tqdm(prefill, desc="attention", leave=False):
            if ctx.out_of_time(f"attention {batch}x{seq}"):
                continue
            try:
                out["attention"].append(_attention_case(ctx, gen, dtype, heads, batch, seq, seq, _pads(batch, seq)))
            except Exception as exc:
                ctx.failed(f"attention {batch}x{seq}", exc)
        decode = ctx.grid(DECODE_GRID, QUICK_DECODE_GRID, HEADLINE_DECODE, QUICK_HEADLINE_DECODE)
        for batch, context in tqdm(decode, desc="decode attn", leave=False):
            if ctx.out_of_time(f"decode attention {batch}x{context}"):
                continue
            try:
                out["decode_attention"].append(_attention_case(ctx, gen, dtype, heads, batch, 1, context, [0] * batch))
            except Exception as exc:
                ctx.failed(f"decode attention {batch}x{context}", exc)
        windowed = [("attention", b, t, t, w) for b, t, w in ctx.grid(WINDOW_PREFILL, QUICK_WINDOW_PREFILL)]
        windowed += [("decode_attention", b, 1, t, w) for b, t, w in ctx.grid(WINDOW_DECODE, QUICK_WINDOW_DECODE)]
        for key, batch, lq, lk, window in tqdm(windowed, desc="window attn", leave=False):
            if ctx.out_of_time(f"{key} {batch}x{lk} window {window}"):
                continue
            try:
                out[key].append(_attention_case(ctx, gen, dtype, heads, batch, lq, lk, [0] * batch, window))
            except Exception as exc:
                ctx.failed(f"{key} {batch}x{lk} window {window}", exc)
        for batch, lq, lk, window in tqdm(ctx.grid(SINK_CASES, QUICK_SINK_CASES), desc="sink attn", leave=False):
            key = "attention" if lq > 1 else "decode_attention"
            if ctx.out_of_time(f"{key} {batch}x{lk} sinks window {window}"):
                continue
            try:
                out[key].append(_attention_case(ctx, gen, dtype, heads, batch, lq, lk, [0] * batch, window, True))
            except Exception as exc:
                ctx.failed(f"{key} {batch}x{lk} sinks window {window}", exc)
    out[attention_vs_stock.KEY] = attention_vs_stock.run(ctx, gen, dtype, heads)
    return out
