"""summary.md of a GPU check: the section table, the headline ratios side by side (invariant / stock
time per item), the GPU tests' and golden digests' outcome, and each other benchmark section's short
summary."""
from __future__ import annotations

import json
from pathlib import Path

from .stock_ratio_rows import ratio_rows as stock_kernel_rows
from .value_format import fmt

RATIO_COLUMNS = ("section", "item", "stock", "invariant", "invariant/stock time", "bits")


def _results(details: Path, name: str) -> dict | None:
    try:
        return json.loads((details / name / "results.json").read_text())
    except (OSError, ValueError):
        return None


def _ms(value) -> str:
    return f"{fmt(value)} ms" if value is not None else "–"


def _tps(value) -> str:
    return f"{fmt(value)} tok/s" if value is not None else "–"


def ratio_rows(name: str, results: dict) -> list[tuple]:
    """(section, item, stock, invariant, invariant/stock time, bits) per measured item."""
    rows = []
    for r in results.get("matmul") or []:
        rows.append((name, f"GEMM {r['shape']} M={r['M']} ({r['N']}x{r['K']})", _ms(r["stock_ms"]),
                     _ms(r["invariant_ms"]), fmt(r["ratio"]),
                     f"row 0 as at M={r.get('row0_reference_M', '?')}: {fmt(r.get('invariant_row0_equal'))}"))
    for key, label in (("attention", "attention prefill"), ("decode_attention", "attention decode")):
        for r in results.get(key) or []:
            extra = (f", window {r['window']}" if r.get("window") else "") + (", sinks" if r.get("sinks") else "")
            rows.append((name, f"{label} B={r['batch']} q={r['q_len']} kv={r['kv_len']}{extra}", _ms(r["stock_ms"]),
                         _ms(r["invariant_ms"]), fmt(r["ratio"]), "–"))
    for r in results.get("e2e") or []:
        rows.append((name, f"e2e scoring {r['batch']}x{r['seq']}", _ms(r.get("stock_ms")), _ms(r.get("invariant_ms")),
                     fmt(r.get("ratio")), "–"))
    for r in results.get("decode") or []:
        rows.append((name, f"e2e decode B={r['batch']} prompt {r['prompt']} +{r['new_tokens']}",
                     _tps(r.get("stock_decode_tokens_per_s")), _tps(r.get("invariant_decode_tokens_per_s")),
                     fmt(r.get("ratio")), "–"))
    engine = {(r["mode"], r["concurrency"]): r for r in results.get("engine") or []}
    for (mode, conc), inv in engine.items():
        if mode != "invariant_engine":
            continue
        stock = engine.get(("stock_engine", conc))
        ratio = (stock["tokens_per_s"] / inv["tokens_per_s"] if stock and stock.get("tokens_per_s")
                 and inv.get("tokens_per_s") else None)
        checked = inv.get("invariant_rows_checked")
        rows.append((name, f"engine c={conc} ({inv['requests']} requests)", _tps(stock and stock.get("tokens_per_s")),
                     _tps(inv.get("tokens_per_s")), fmt(ratio),
                     f"equal alone {inv['invariant_rows_equal']}/{checked}" if checked else "–"))
    return rows + stock_kernel_rows(name, results)


def markdown(records: list[dict], details: Path, header: list[str], ratio_sections, summary_of) -> str:
    """``ratio_sections``: names whose results.json feed the ratio table; ``summary_of(results)``: the
    short summary text of one results.json (benchmarks.report_summary.summary, imported by the caller
    only when some section wrote one)."""
    out = ["# GPU check", "", *header, ""]
    out += ["## Sections", "", "| section | status | seconds | rc | notes |", "|---|---|---:|---:|---|"]
    for r in records:
        notes = r.get("reason") or ""
        if r["name"] == "gpu_tests" and "tests_selected" in r:
            counts = ", ".join(f"{v} {k}" for k, v in sorted((r.get("counts") or {}).items()))
            notes = f"{r['tests_selected']} selected; {counts or 'no outcome'}" + (f"; {notes}" if notes else "")
        if r["name"] == "golden_digests" and "digests" in r:
            notes = f"{r['digests']} digests" + (f"; parts failed: {sorted(r['part_errors'])}" if r.get("part_errors")
                                                 else "") + (f"; {notes}" if notes else "")
        if "rows" in r:
            notes = f"{r['rows']} rows" + (f", {r['items_out_of_time']} items not started (time)"
                                           if r.get("items_out_of_time") else "") + (f"; {notes}" if notes else "")
        out.append(f"| {r['name']} | {r['status']} | {r['seconds']} | {fmt(r.get('rc'))} | "
                   f"{notes.replace('|', '/')} |")
    rows = []
    for name in ratio_sections:
        results = _results(details, name)
        if results:
            rows += ratio_rows(name, results)
    out += ["", "## Headline ratios (invariant / stock time per item; > 1: invariant is slower)", ""]
    if rows:
        out += ["| " + " | ".join(RATIO_COLUMNS) + " |", "|" + "---|" * len(RATIO_COLUMNS)]
        out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    else:
        out.append("_no ratio was measured (see the sections above)_")
    tests = next((r for r in records if r["name"] == "gpu_tests"), None)
    if tests and tests.get("left_out"):
        out += ["", "## Test files left out (a module they import is missing here)", ""]
        out += [f"- `{e['file']}`: `{e['missing_module']}`" for e in tests["left_out"]]
    for r in records:
        results = _results(details, r["name"]) if r["name"] not in ratio_sections else None
        if results:
            try:
                text = summary_of(results)
            except Exception as exc:  # a results.json of an older schema: the table above still stands
                text = f"(no summary: {type(exc).__name__}: {exc})"
            out += ["", f"## {r['name']}", "", "```", text, "```"]
    return "\n".join(out) + "\n"
