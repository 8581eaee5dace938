"""Attention against the fastest stock kernels importable here (``benchmarks.stock_kernels``): the
``attention_vs_stock`` rows of the norm_attention section.

  * ``prefill``: unpadded causal rows, the invariant ``attention`` against SDPA on its flash backend
    and FlashAttention's ``flash_attn_func``;
  * ``decode``: one query per sequence after a long context (past many KV blocks, so the split-KV
    tree runs), the invariant ``attention`` (Lq = 1) and ``paged_attention`` (the same keys in pages
    scattered over a cache, as the engine holds them) against FlashInfer's decode, FlashAttention's
    ``flash_attn_with_kvcache`` and SDPA.

Per item every kernel runs once as its warm-up, then is timed, invariant and stock back to back; one
row per (item, invariant kernel, stock kernel) with invariant time / stock time. A stock kernel not
importable here gives its rows ``skipped`` ("flash_attn not importable"), never a failed item.
``bitwise_equal_to_attention`` (paged rows): ``paged_attention``'s output ``torch.equal`` to
``attention``'s on the same keys."""
from __future__ import annotations

import torch

from invariant_infer.kernels import attention, paged_attention
from invariant_infer.kernels.configs import attention_config

from .matmul import max_abs_diff
from .stock_kernels import decode_stocks, device_label, paged_cache, prefill_stocks
from .timing import Run, time_ms

KEY = "attention_vs_stock"
# (batch, tokens) of prefill; (batch, context) of decode. Headline: 8 x 2048 prefill, and decode
# at 8K context alone and batched (the split-KV rows).
PREFILL, QUICK_PREFILL = [(1, 2048), (8, 2048), (1, 8192)], [(2, 48)]
HEADLINE_PREFILL, QUICK_HEADLINE_PREFILL = [(8, 2048)], [(2, 48)]
DECODE = [(b, c) for b in (1, 16, 64) for c in (2048, 8192)] + [(1, 32768)]
QUICK_DECODE = [(1, 200), (2, 200)]  # past three of the interpreter's 64-key blocks
HEADLINE_DECODE, QUICK_HEADLINE_DECODE = [(1, 8192), (16, 8192)], [(2, 200)]
COLUMNS = [("case", "case"), ("batch", "batch"), ("q len", "q_len"), ("kv len", "kv_len"), ("heads q/kv/d", "_heads"),
           ("invariant", "invariant"), ("stock", "stock"), ("invariant ms", "invariant_ms"), ("stock ms", "stock_ms"),
           ("ratio", "ratio"), ("max abs Δ", "max_abs_diff"), ("paged = attention", "bitwise_equal_to_attention"),
           ("skipped", "skipped")]


def _timed(ctx: Run, fn, invariant: bool) -> float:
    if invariant:  # the interpreter: one run says all it can
        return time_ms(fn, ctx.device, reps=3 if ctx.on_gpu else 1, warmup=0, flush_l2=True)
    return time_ms(fn, ctx.device, warmup=0, flush_l2=True)


def _inputs(ctx: Run, gen, dtype, heads: tuple, batch: int, lq: int, lk: int):
    hq, hkv, d = heads
    q = torch.randn(batch, hq, lq, d, generator=gen, device=ctx.device, dtype=dtype)
    k = torch.randn(batch, hkv, lk, d, generator=gen, device=ctx.device, dtype=dtype)
    v = torch.randn(batch, hkv, lk, d, generator=gen, device=ctx.device, dtype=dtype)
    return q, k, v


def _invariant_kernels(ctx: Run, q, k, v, case: str):
    """({name: (fn, extra row fields)} of the invariant kernels this case runs, the paged cache or None)."""
    batch, hq, lq, d = q.shape
    lk, scale = k.shape[2], d ** -0.5
    i32 = dict(device=ctx.device, dtype=torch.int32)
    kv_start, kv_end = torch.zeros(batch, **i32), torch.full((batch,), lk, **i32)
    q_start = torch.full((batch,), lk - lq, **i32)
    kernels = {"attention": (lambda: attention(q, k, v, kv_start, kv_end, q_start, scale), {"page_size": None})}
    cache = None
    if case == "decode":
        # pages of one KV block each, as the engine sizes them (ModelRunner.page_size_for)
        cache = paged_cache(k, v, attention_config(ctx.device.type, q.dtype, d).block_n)
        packed, starts = q[:, :, 0].contiguous(), torch.arange(batch + 1, **i32)
        kernels["paged_attention"] = (lambda: paged_attention(
            packed, cache.k, cache.v, starts, cache.seq_lens, cache.block_tables, scale, max_query_len=1).unsqueeze(1),
            {"page_size": cache.page_size})
    return kernels, cache


def _item(ctx: Run, gen, dtype, heads: tuple, case: str, batch: int, lq: int, lk: int) -> list[dict]:
    q, k, v = _inputs(ctx, gen, dtype, heads, batch, lq, lk)
    kernels, cache = _invariant_kernels(ctx, q, k, v, case)
    invariant = {}
    for name, (fn, extra) in kernels.items():
        out = fn()  # the warm-up (Triton compiles here)
        invariant[name] = (out, _timed(ctx, fn, invariant=True), extra)
    stocks = prefill_stocks(q, k, v) if case == "prefill" else decode_stocks(q, k, v, cache)
    measured = {}
    for stock in stocks:
        if stock.fn is not None:
            measured[stock.name] = (stock.fn(), _timed(ctx, stock.fn, invariant=False))
    reference = invariant["attention"][0]
    rows = []
    for name, (out, inv_ms, extra) in invariant.items():
        for stock in stocks:
            y, stock_ms = measured.get(stock.name, (None, None))
            rows.append({
                "case": case, "batch": batch, "q_len": lq, "kv_len": lk, "heads": heads[0], "kv_heads": heads[1],
                "head_dim": heads[2], "dtype": str(dtype).removeprefix("torch."), "device": device_label(ctx.device),
                "invariant": name, "stock": stock.name, "invariant_ms": inv_ms, "stock_ms": stock_ms,
                "ratio": inv_ms / stock_ms if stock_ms else None,
                "max_abs_diff": max_abs_diff(out, y) if y is not None else None,
                "bitwise_equal_to_attention": bool(torch.equal(out, reference)) if name != "attention" else None,
                "skipped": stock.skipped, **extra})
    return rows


def run(ctx: Run, gen, dtype, heads: tuple) -> list[dict]:
    """The section's ``attention_vs_stock`` rows (``heads``: query heads, KV heads, head_dim)."""
    prefill = ctx.grid(PREFILL, QUICK_PREFILL, HEADLINE_PREFILL, QUICK_HEADLINE_PREFILL)
    items = [("prefill", b, t, t) for b, t in prefill]
    items += [("decode", b, 1, c) for b, c in ctx.grid(DECODE, QUICK_DECODE, HEADLINE_DECODE, QUICK_HEADLINE_DECODE)]
    rows = []
    for case, batch, lq, lk in items:
        label = f"attention vs stock {case} {batch}x{lk}"
        if ctx.out_of_time(label):
            continue
        try:
            with torch.no_grad():
                rows += _item(ctx, gen, dtype, heads, case, batch, lq, lk)
        except Exception as exc:  # an invariant kernel failed: the item fails, the section goes on
            ctx.failed(label, exc)
    return rows


def markdown(results: dict, table) -> str:
    """RESULTS.md's table of these rows (empty when the section did not run)."""
    rows = results.get(KEY) or []
    if not rows:
        return ""
    for row in rows:
        row["_heads"] = f"{row.get('heads')}/{row.get('kv_heads')}/{row.get('head_dim')}"
    return ("\n## Attention against the fastest stock kernels importable here\n\n"
            "prefill: unpadded causal rows, `kernels.attention` vs SDPA's flash backend and FlashAttention; decode: "
            "one query per sequence, `kernels.attention` and `kernels.paged_attention` vs FlashInfer, "
            "FlashAttention's `flash_attn_with_kvcache` and SDPA. ratio = invariant ms / stock ms; paged = "
            "attention: bitwise.\n\n"
            + table(rows, COLUMNS))
