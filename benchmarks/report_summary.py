"""The short summary table ``python -m benchmarks.report --summary results.json`` prints."""
from __future__ import annotations

import math

from .report_markdown import fmt
from .schema import NOT_MEANINGFUL, model_name
from .stock_ratio_rows import summary_lines as stock_kernel_lines


def _geomean(values):
    values = [v for v in values if v and v > 0]
    return math.exp(sum(map(math.log, values)) / len(values)) if values else None


def summary(results: dict) -> str:
    lines = [f"{results['device']} | {model_name(results)} | commit {results['commit']} | torch {results['torch']} "
             f"triton {results['triton']} transformers {results['transformers']}"
             + ("" if results.get("timings_meaningful") else f" | {NOT_MEANINGFUL}")]
    shapes = list(dict.fromkeys(r["shape"] for r in results.get("matmul") or []))
    for shape in shapes:
        rows = [r for r in results["matmul"] if r["shape"] == shape]
        lines.append(f"matmul {shape:8s} invariant/stock time ratio geomean {fmt(_geomean([r['ratio'] for r in rows]))}"
                     f"  (M {rows[0]['M']}..{rows[-1]['M']}: {', '.join(fmt(r['ratio']) for r in rows)})")
    for r in results.get("e2e") or []:
        lines.append(f"e2e {r['batch']}x{r['seq']}: stock {fmt(r['stock_tokens_per_s'])} tok/s, invariant "
                     f"{fmt(r['invariant_tokens_per_s'])} tok/s, peak GB {fmt(r['stock_peak_gb'])} / "
                     f"{fmt(r['invariant_peak_gb'])}")
    for r in results.get("decode") or []:
        lines.append(f"decode B={r['batch']}: stock {fmt(r.get('stock_decode_tokens_per_s'))} tok/s, invariant "
                     f"{fmt(r.get('invariant_decode_tokens_per_s'))} tok/s")
    for r in results.get("scoring_memory") or []:
        lines.append(f"logprobs T={r['tokens']} V={r['vocab']}: peak GB naive {fmt(r['naive_peak_gb'])} / ours "
                     f"{fmt(r['ours_peak_gb'])} ({r['peak_gb_method']}), max|Δ logprob| {fmt(r['max_abs_diff'])}, "
                     f"is-argmax agree {fmt(r['is_argmax_agree'])}")
    for r in results.get("scoring_throughput") or []:
        lines.append(f"score_sequences {r['sequences']} seqs / {r['tokens']} tokens: stock "
                     f"{fmt(r['stock_tokens_per_s'])} tok/s, invariant {fmt(r['invariant_tokens_per_s'])} tok/s, "
                     f"digests equal across budgets {fmt(r['digests_equal_across_budgets'])}")
    for r in results.get("engine") or []:
        if r["mode"] == "invariant_engine":
            checked = r.get("invariant_rows_checked")
            lines.append(f"engine c={r['concurrency']}: invariant {fmt(r['tokens_per_s'])} tok/s, TPOT "
                         f"{fmt(r['tpot_ms'])} ms; ÷ stock engine {fmt(r['invariant_to_stock_engine'])}, "
                         f"÷ HF generate {fmt(r['invariant_to_hf_generate'])}"
                         + (f"; equal alone {r['invariant_rows_equal']}/{checked}" if checked else ""))
    for r in results.get("host_overhead") or []:
        stand_in = " (stand-in forward)" if r.get("forward") == "stand-in" else ""
        lines.append(f"host overhead {r['kernels']}{stand_in} running={r['running']} context={r.get('context')}: host {fmt(r['host_us'])} µs/step "
                     f"({fmt(r['host_us_per_seq'])} µs/seq; schedule {fmt(r['schedule_us'])}, metadata "
                     f"{fmt(r['metadata_us'])}, sampling {fmt(r['sampling_us'])}, output {fmt(r['output_us'])}); "
                     f"forward {fmt(r['forward_us'])} µs")
    for r in results.get("server") or []:
        checked = r.get("invariant_rows_checked")
        lines.append(f"server {r['mode']} c={r['concurrency']}: {fmt(r['tokens_per_s'])} tok/s, "
                     f"{fmt(r['requests_per_s'])} req/s, p50 {fmt(r['p50_ms'])} ms, p99 {fmt(r['p99_ms'])} ms, "
                     f"errors {r['errors']}"
                     + (f"; ÷ stock {fmt(r['invariant_to_stock'])}" if r.get("invariant_to_stock") else "")
                     + (f"; equal alone {r['invariant_rows_equal']}/{checked}" if checked else ""))
    for r in results.get("train") or []:
        lines.append(f"train {r['layout']} {r['batch']}x{r['seq']}: stock {fmt(r['stock_tokens_per_s'])} tok/s, "
                     f"invariant {fmt(r['invariant_tokens_per_s'])} tok/s (time ratio {fmt(r['ratio'])}); logprob "
                     f"mismatch batch vs alone: stock {fmt(r['stock_logprob_max_abs_diff'])}, invariant "
                     f"{fmt(r['invariant_logprob_max_abs_diff'])}")
    for r in results.get("moe") or []:
        ratio = f" (time ratio {fmt(r['invariant_time_ratio'])})" if r.get("invariant_time_ratio") else ""
        lines.append(f"moe {r['implementation']} T={r['tokens']}: {fmt(r['tokens_per_s'])} tok/s{ratio}; alone vs "
                     f"batch max|Δ| {fmt(r['alone_max_abs_diff'])}" + (f"; {r['skipped']}" if r.get("skipped") else ""))
    for r in results.get("gdn") or []:
        ratio = f" (time ratio {fmt(r['invariant_time_ratio'])})" if r.get("invariant_time_ratio") else ""
        equal = f"; decode = prefill: {r['decode_equals_prefill']}" if r.get("decode_equals_prefill") is not None else ""
        lines.append(f"gdn {r['case']} {r['implementation']} B={r['sequences']} T={r['tokens']}: "
                     f"{fmt(r['tokens_per_s'])} tok/s{ratio}{equal}" + (f"; {r['skipped']}" if r.get("skipped") else ""))
    for r in results.get("gdn_prefill") or []:
        lines.append(f"gdn model prefill {r['batch']}x{r['seq']}: stock {fmt(r['stock_tokens_per_s'])} tok/s, "
                     f"invariant {fmt(r['invariant_tokens_per_s'])} tok/s")
    for r in results.get("gdn_decode") or []:
        lines.append(f"gdn model decode B={r['batch']}: stock {fmt(r.get('stock_decode_tokens_per_s'))} tok/s, "
                     f"invariant {fmt(r.get('invariant_decode_tokens_per_s'))} tok/s")
    for r in results.get("tp_steps") or []:
        lines.append(f"tensor parallel TP {r['tp']}: prefill step {fmt(r['prefill_step_ms'])} ms, decode step "
                     f"{fmt(r['decode_step_ms'])} ms (x{fmt(r['decode_ratio_to_tp1'])} TP 1); bitwise = TP 1 "
                     f"{r['bitwise_equal_to_tp1']}")
    for key in ("rmsnorm", "attention", "decode_attention"):
        rows = results.get(key) or []
        if rows:
            lines.append(f"{key} invariant/stock time ratio geomean {fmt(_geomean([r['ratio'] for r in rows]))} "
                         f"over {len(rows)} cases")
    lines += stock_kernel_lines(results)
    for r in results.get("spec") or []:  # speculative decoding: speedup and bits per workload and batch
        if r.get("speculative"):
            lines.append(f"spec {r['workload']} batch={r['batch']}: {fmt(r['speedup'])}x, acceptance "
                         f"{fmt(r['acceptance_length'])}, forwards/token {fmt(r['forwards_per_token'])}, bitwise equal "
                         f"{fmt(r['bitwise_equal'])}")
    for r in results.get("quant") or []:  # quantized GEMMs: time ratios, weight bytes and bits
        if r.get("ratio") is not None:
            lines.append(f"quant {r['model']} {r['shape']} {r['format']} M={r['M']}: {fmt(r['ratio'])}x {r['stock']}, "
                         f"{fmt(r['ratio_to_bf16'])}x bf16, bytes {fmt(r['bytes_ratio'])} of bf16, alone bitwise "
                         f"invariant {fmt(r['invariant_alone_bitwise_equal'])} stock "
                         f"{fmt(r['stock_alone_bitwise_equal'])}")
    for r in results.get("lora") or []:  # LoRA: tokens/s relative to the base model (goal: <= 1.10 at 4 adapters)
        if r.get("time_ratio_to_base") is not None:
            lines.append(f"lora {r['mode']} {r['phase']} adapters={r['adapters']}: {fmt(r['tokens_per_s'])} tok/s, "
                         f"{fmt(r['time_ratio_to_base'])}x base, bitwise {fmt(r['bitwise_rows_equal'])}/"
                         f"{fmt(r['bitwise_rows_checked'])}")
    for r in results.get("embed") or []:  # embedding models: sequences/s, invariant vs stock
        if r.get("ratio") is not None:
            lines.append(f"embed {r['model']} B={r['batch']}: invariant {fmt(r['invariant_sequences_per_s'])} seq/s, "
                         f"stock {fmt(r['stock_sequences_per_s'])} (time ratio {fmt(r['ratio'])})")
    for r in results.get("embed_divergence") or []:
        lines.append(f"embed divergence {r['model']} B={r['batch']}: stock max|Δ| {fmt(r['stock_max_abs_diff'])} "
                     f"({fmt(r['stock_rows_unequal'])}/{fmt(r['stock_rows_checked'])} rows differ); invariant "
                     f"{fmt(r['invariant_max_abs_diff'])} ({fmt(r['invariant_rows_unequal'])}/"
                     f"{fmt(r['invariant_rows_checked'])})")
    for r in results.get("divergence") or []:
        lines.append(f"divergence {r['case']}: stock max|Δ| {fmt(r['stock_max_abs_diff'])} "
                     f"({fmt(r['stock_rows_unequal'])}/{fmt(r.get('stock_rows_checked'))} rows differ); invariant "
                     f"{fmt(r['invariant_max_abs_diff'])} ({fmt(r['invariant_rows_unequal'])}/"
                     f"{fmt(r.get('invariant_rows_checked'))})")
    if results.get("skipped"):
        lines.append(f"skipped/failed items: {len(results['skipped'])} (see RESULTS.md)")
    return "\n".join(lines)
