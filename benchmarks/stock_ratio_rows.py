"""How the rows measured against the fastest stock kernels read in the GPU check's headline table
and in the short summary: ``attention_vs_stock`` (norm_attention) and ``quant`` rows. No torch here:
the GPU check's runner imports it."""
from __future__ import annotations

from .value_format import fmt


def _ms(value) -> str:
    return f"{fmt(value)} ms" if value is not None else "–"


def _attention_item(r: dict) -> str:
    return (f"attention {r['case']} B={r['batch']} q={r['q_len']} kv={r['kv_len']} "
            f"(heads {r['heads']}/{r['kv_heads']}/{r['head_dim']}): {r['invariant']} vs {r['stock']}")


def ratio_rows(name: str, results: dict) -> list[tuple]:
    """(section, item, stock, invariant, invariant/stock time, bits) per row; a skipped stock kernel
    shows its reason in the stock column."""
    rows = []
    for r in results.get("attention_vs_stock") or []:
        bits = (f"paged = attention: {fmt(r['bitwise_equal_to_attention'])}"
                if r.get("bitwise_equal_to_attention") is not None else "–")
        rows.append((name, _attention_item(r), r["skipped"] or _ms(r["stock_ms"]), _ms(r["invariant_ms"]),
                     fmt(r["ratio"]), bits))
    for r in results.get("quant") or []:
        item = f"{r['format']} GEMM {r['shape']} M={r['M']} ({r['N']}x{r['K']}) vs {r['stock'] or 'stock'}"
        stock = r.get("skipped") or _ms(r["stock_ms"])
        if r.get("stock_skipped") and not r.get("skipped"):
            stock += f" ({r['stock_skipped']})"
        bits = (f"rows alone: {fmt(r['invariant_alone_bitwise_equal'])}"
                if r.get("invariant_alone_bitwise_equal") is not None else "–")
        rows.append((name, item, stock, _ms(r["invariant_ms"]), fmt(r["ratio"]), bits))
    return rows


def summary_lines(results: dict) -> list[str]:
    """The short summary's lines of ``attention_vs_stock`` rows (the quant rows have their own): one
    per measured row, and one per stock kernel skipped, with its reason."""
    lines, skipped = [], {}
    for r in results.get("attention_vs_stock") or []:
        if r.get("skipped"):
            skipped.setdefault(r["stock"], r["skipped"])
            continue
        lines.append(f"{_attention_item(r)}: {fmt(r['ratio'])}x ({fmt(r['invariant_ms'])} / {fmt(r['stock_ms'])} ms)"
                     + (f", paged = attention {fmt(r['bitwise_equal_to_attention'])}"
                        if r.get("bitwise_equal_to_attention") is not None else ""))
    lines += [f"attention vs {stock}: skipped ({why})" for stock, why in skipped.items()]
    return lines
