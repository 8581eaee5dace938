"""RESULTS.md: each section's table, and the display-only keys (prefixed with ``_``) the tables read."""
from __future__ import annotations


from .schema import NOT_MEANINGFUL, model_name
from .value_format import fmt


def table(rows: list, columns: list) -> str:
    """columns: [(header, key)]"""
    if not rows:
        return "_no rows (skipped or failed; see Skipped)_\n"
    lines = ["| " + " | ".join(h for h, _ in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(row.get(key)) for _, key in columns) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def markdown(results: dict) -> str:
    meaningful = results.get("timings_meaningful")
    model, name = results.get("model") or {}, model_name(results)
    out = [f"# Benchmark results: {results['device']} · {name}\n",
           f"commit `{results['commit']}` · torch {results['torch']} · triton {results['triton']} · "
           f"transformers {results['transformers']} · {'quick' if results.get('quick') else 'full'} mode · "
           f"{results.get('created', '')} · {results.get('duration_s', 0):.0f} s\n"]
    if model:
        out.append(f"Model preset **`{name}`** (`--model-preset`): hidden {model['hidden_size']}, MLP "
                   f"{model['intermediate_size']}, heads {model['num_attention_heads']}/{model['num_key_value_heads']}"
                   f"/{model['head_dim']} (q/kv/d), {model['num_hidden_layers']} layers, vocab {model['vocab_size']}, "
                   f"RMSNorm `{model['rms_norm']}`."
                   + (f" Quick mode scales it down: matmul N, K ÷ 16; attention at most 4/2 heads, d 64; e2e and "
                      f"scoring use `{model['family']}:tiny`; divergence keeps the widths with 1 layer, vocab 2048."
                      if results.get("quick") else "") + "\n")
    if not meaningful:
        out.append(f"> **{NOT_MEANINGFUL}.** The invariant kernels run in Triton's Python interpreter here; the "
                   "numbers below check that everything runs and how far logits drift, not speed.\n")
    out.append(f"Timing: {results.get('timing_note')}. Memory: {results.get('memory_note')}.\n")
    out.append("## Divergence: the same row in a batch vs alone\n\nmax |Δ logit| over the row's real tokens; "
               "rows unequal = rows whose logits are not bitwise equal (`torch.equal`), of rows checked.\n")
    out.append(table(results.get("divergence"), [
        ("case", "case"), ("model", "_model"), ("stock max abs Δ", "stock_max_abs_diff"),
        ("stock rows unequal", "_stock_rows"), ("invariant max abs Δ", "invariant_max_abs_diff"),
        ("invariant rows unequal", "_invariant_rows")]))
    out.append(f"\n## Matmul (bf16, {name} shapes{', N and K ÷ 16' if results.get('quick') else ''}): "
               "`F.linear` vs `invariant_infer.kernels.linear`\n\nratio = invariant time / "
               "stock time (above 1 = invariant slower). row0 equal: row 0 of the M-row product is bitwise "
               "equal to the M=1 product.\n")
    out.append(table(results.get("matmul"), [
        ("shape", "shape"), ("M", "M"), ("N", "N"), ("K", "K"), ("stock ms", "stock_ms"),
        ("invariant ms", "invariant_ms"), ("stock TFLOP/s", "stock_tflops"), ("invariant TFLOP/s", "invariant_tflops"),
        ("ratio", "ratio"), ("max abs Δ", "max_abs_diff"), ("stock row0 equal", "stock_row0_equal"),
        ("invariant row0 equal", "invariant_row0_equal")]))
    out.append("\n## End to end: scoring (one forward over batch × seq tokens)\n")
    out.append(table(results.get("e2e"), [
        ("batch", "batch"), ("seq", "seq"), ("model", "_model"), ("stock tok/s", "stock_tokens_per_s"),
        ("invariant tok/s", "invariant_tokens_per_s"), ("time ratio", "ratio"), ("stock peak GB", "stock_peak_gb"),
        ("invariant peak GB", "invariant_peak_gb"), ("last-token max abs Δ", "last_token_max_abs_diff")]))
    out.append("\n## End to end: greedy decode (generate, KV cache; tokens/s of the steps after prefill)\n")
    out.append(table(results.get("decode"), [
        ("batch", "batch"), ("prompt", "prompt"), ("new tokens", "new_tokens"),
        ("stock tok/s", "stock_decode_tokens_per_s"), ("invariant tok/s", "invariant_decode_tokens_per_s"),
        ("stock/invariant", "ratio")]))
    out.append(scoring_markdown(results))
    out.append(engine_markdown(results))
    out.append(host_overhead_markdown(results))
    out.append(server_markdown(results))
    out.append(train_markdown(results))
    out.append(moe_markdown(results))
    out.append(gdn_markdown(results))
    out.append(quant_markdown(results))
    from .vlm import markdown as vlm_markdown  # noqa: PLC0415  (the section's table lives with the section)
    from .embed import markdown as embed_markdown  # noqa: PLC0415  (as vlm's)
    out += [tensor_parallel_markdown(results), spec_markdown(results), vlm_markdown(results, table),
            embed_markdown(results, table)]
    out.append(f"\n## RMSNorm: HF `{model.get('rms_norm', 'Qwen2RMSNorm')}` vs `invariant_infer.kernels.rms_norm`\n")
    out.append(table(results.get("rmsnorm"), [
        ("M", "M"), ("N", "N"), ("stock ms", "stock_ms"), ("invariant ms", "invariant_ms"), ("ratio", "ratio"),
        ("stock GB/s", "stock_gbps"), ("invariant GB/s", "invariant_gbps"), ("bitwise = stock", "bitwise_equal_to_stock")]))
    attn_cols = [("batch", "batch"), ("q len", "q_len"), ("kv len", "kv_len"), ("heads q/kv/d", "_heads"),
                 ("padded rows", "padded_rows"), ("window", "window"), ("sinks", "sinks"), ("stock ms", "stock_ms"),
                 ("invariant ms", "invariant_ms"),
                 ("ratio", "ratio"), ("max abs Δ", "max_abs_diff")]
    out.append("\n## Prefill attention (causal, GQA, left padding; window: a sliding window of that many keys, "
               "SDPA given the windowed mask; sinks: gpt-oss's attention sinks, stock is transformers' eager sink "
               "attention): torch SDPA vs `invariant_infer.kernels.attention`\n")
    out.append(table(results.get("attention"), attn_cols))
    out.append("\n## Decode attention (Lq = 1)\n")
    out.append(table(results.get("decode_attention"), attn_cols))
    from .attention_vs_stock import markdown as attention_vs_stock_markdown  # noqa: PLC0415  (as vlm's)
    out.append(attention_vs_stock_markdown(results, table))
    if results.get("skipped"):
        out.append("\n## Skipped\n")
        out.append(table(results["skipped"], [("section", "section"), ("item", "item"), ("reason", "reason")]))
    if results.get("plots"):
        out.append("\n## Plots\n")
        out += [f"![{p}]({p})\n" for p in results["plots"]]
    return "\n".join(out)


def scoring_markdown(results: dict) -> str:
    out = ["\n## Scoring: per-token logprobs from final hidden states, naive vs chunked\n\n"
           "naive = `naive_token_logprobs` (full fp32 [T × V] logits, `torch.log_softmax`, gather); ours = "
           "`token_logprobs_from_hidden` (lm_head on `chunk rows` at a time through the invariant linear, each chunk "
           "reduced by the `token_logprobs` kernel). Peak = memory above the inputs (hidden, lm_head weight, "
           "targets). max |Δ| = max |naive − ours| logprob; half the targets are the stock argmax, and is-argmax agree "
           "= the two is-argmax flags are equal on every row.\n"]
    memory = results.get("scoring_memory") or []
    if any(r.get("peak_gb_method") == "estimate" for r in memory):
        out.append("> **Peak MB marked `estimate` are analytic estimates, not measurements** (torch's CPU allocator "
                   "is invisible to tracemalloc): naive = T × V × 8 B (fp32 logits + fp32 log_softmax); ours = "
                   "min(chunk rows, T) × V × dtype bytes + the [T] outputs.\n")
    out.append(table(memory, [
        ("T", "tokens"), ("H", "hidden"), ("V", "vocab"), ("dtype", "dtype"), ("chunk rows", "chunk_rows"),
        ("naive peak MB", "_naive_peak_mb"), ("ours peak MB", "_ours_peak_mb"), ("peak method", "peak_gb_method"),
        ("naive / ours memory", "memory_ratio"), ("naive ms", "naive_ms"), ("ours ms", "ours_ms"),
        ("max abs Δ logprob", "max_abs_diff"), ("is-argmax agree", "_argmax")]))
    out.append("\n## Scoring throughput: `score_sequences` vs the stock way\n\nstock = the same batch plan, "
               "right-padded HF forward, `torch.log_softmax` over the full fp32 logits, gather; invariant = "
               "`score_sequences(make_invariant(model), …)`. tok/s counts every input token. max |Δ| = invariant "
               "vs stock logprobs. digests equal = `score_sequences` digests are identical for `max_batch_tokens` "
               "and the alternative budget (different batches). Peak GB includes the weights.\n")
    out.append(table(results.get("scoring_throughput"), [
        ("sequences", "sequences"), ("lengths", "_lengths"), ("tokens", "tokens"), ("model", "_model"),
        ("max_batch_tokens (batches)", "_budget"), ("stock tok/s", "stock_tokens_per_s"),
        ("invariant tok/s", "invariant_tokens_per_s"), ("time ratio", "ratio"), ("stock peak GB", "stock_peak_gb"),
        ("invariant peak GB", "invariant_peak_gb"), ("max abs Δ logprob", "max_abs_diff"),
        ("alt budget (batches)", "_alt_budget"), ("digests equal", "digests_equal_across_budgets")]))
    return "\n".join(out)


ENGINE_MODES = {"invariant_engine": "engine, invariant kernels", "stock_engine": "engine, stock kernels",
                "hf_generate": "HF generate (stock)", "invariant_engine_eager": "engine, invariant, no CUDA graphs"}


def engine_markdown(results: dict) -> str:
    rows = results.get("engine") or []
    first = rows[0] if rows else {}
    model = (f" ({first.get('preset')}, {first.get('layers')} layers, hidden {first.get('hidden')}, "
             f"{first.get('dtype')})" if rows else "")
    shape = (f" Prompts of {first.get('min_prompt')}–{first.get('max_prompt')} random tokens, "
             f"{first.get('max_tokens')} greedy new tokens each (`ignore_eos`)." if rows else "")
    out = [f"\n## Serving engine{model}: invariant vs stock kernels vs HF generate\n\n"
           "Concurrency = requests in flight: the engine keeps that many in a closed loop (`max_num_seqs` = "
           "concurrency); HF `generate` runs left-padded batches of that many, one after the other. tok/s = "
           "output tokens / wall time; TPOT = mean over requests of (finish − first token) / (tokens − 1); "
           "TTFT = mean of first token − submission. ÷ stock engine, ÷ HF generate: invariant engine tok/s over "
           "theirs (below 1 = invariant slower); ÷ no graphs: the same over the invariant engine without CUDA graphs "
           "(GPU only). Equal alone: requests whose tokens and logprobs are bitwise "
           f"those of the same request alone, of those checked (at concurrency 1 every request runs alone).{shape}\n"]
    out.append(table(rows, [
        ("mode", "_mode"), ("concurrency", "concurrency"), ("requests", "requests"), ("output tokens", "output_tokens"),
        ("tok/s", "tokens_per_s"), ("TPOT ms", "tpot_ms"), ("TTFT ms", "ttft_ms"),
        ("÷ stock engine", "invariant_to_stock_engine"), ("÷ HF generate", "invariant_to_hf_generate"),
        ("÷ no graphs", "graphs_to_eager"), ("equal alone", "_alone"), ("preemptions", "preemptions")]))
    return "\n".join(out)


def host_overhead_markdown(results: dict) -> str:
    rows = results.get("host_overhead") or []
    if not rows and "host_overhead" not in (results.get("sections") or []):
        return ""
    first = rows[0] if rows else {}
    model = (f" ({first.get('preset')}, {first.get('layers')} layers, hidden {first.get('hidden')}, "
             f"{first.get('dtype')})" if rows else "")
    device = ("" if results.get("timings_meaningful") else
              "\n> **Host phases are meaningful on CPU** (the same Python as on a GPU); **the device phases "
              "(forward, logprobs) run through the Triton interpreter here: NOT meaningful.**\n")
    out = [f"\n## Engine host overhead{model}: µs per decode step, per phase\n\n"
           "`running` sequences of `tokens so far` tokens decode together, one token each per step, greedy, outputs as deltas; per phase the median of the timed steps, host µs = the sum of the host medians. "
           "Host: schedule (scheduler), metadata (packing the step into the runner's buffers), sampling (each "
           "sequence's next token), output (bookkeeping, stop checks, outputs); device: forward (model + "
           "lm_head) and logprobs (the token-logprob kernel), each phase boundary synchronized on CUDA. host µs "
           "/ seq = host µs ÷ running. Forward `stand-in`: random hidden states instead of the model, the host "
           "path alone (on CPU a real forward evicts the host's data from the CPU caches, which a GPU's does not)."
           f"\n{device}"]
    out.append(table(rows, [
        ("kernels", "kernels"), ("forward", "forward"), ("running", "running"), ("tokens so far", "context"), ("steps", "steps"),
        ("schedule", "schedule_us"),
        ("metadata", "metadata_us"), ("sampling", "sampling_us"), ("output", "output_us"),
        ("host µs", "host_us"), ("host µs / seq", "host_us_per_seq"), ("forward", "forward_us"),
        ("logprobs", "logprobs_us"), ("host share", "host_fraction")]))
    return "\n".join(out)


SERVER_MODES = {"invariant": "serve, invariant kernels", "stock": "serve --kernels stock"}


def server_markdown(results: dict) -> str:
    rows = results.get("server") or []
    if not rows and "server" not in (results.get("sections") or []):
        return ""
    first = rows[0] if rows else {}
    model = (f" ({first.get('preset')}, {first.get('layers')} layers, hidden {first.get('hidden')}, "
             f"{first.get('dtype')})" if rows else "")
    shape = (f" Prompts of {first.get('min_prompt')}–{first.get('max_prompt')} random token ids, "
             f"{first.get('max_tokens')} greedy new tokens each (`ignore_eos`)." if rows else "")
    out = [f"\n## HTTP server{model}: `invariant-infer serve`, invariant vs stock kernels\n\n"
           "The real server in a subprocess on 127.0.0.1, one per mode, driven by a closed loop of `concurrency` "
           "client threads (`/v1/completions`, non-streaming). tok/s = output tokens (`usage.completion_tokens`) / "
           "wall time; req/s likewise; p50 / p99 = request latency (send to full response). errors = responses "
           "that are not 200. ÷ stock = invariant tok/s over stock tok/s at the same concurrency (below 1 = "
           "invariant slower). Equal alone: responses (choices and usage, `==`) equal to the same request alone, "
           f"of those checked (at concurrency 1 every request runs alone).{shape}\n"]
    out.append(table(rows, [
        ("mode", "_mode"), ("concurrency", "concurrency"), ("requests", "requests"), ("output tokens", "output_tokens"),
        ("tok/s", "tokens_per_s"), ("req/s", "requests_per_s"), ("p50 ms", "p50_ms"), ("p99 ms", "p99_ms"),
        ("errors", "errors"), ("÷ stock", "invariant_to_stock"), ("equal alone", "_alone")]))
    return "\n".join(out)


TRAIN_LAYOUTS = {"padded": "padded (right)", "packed": "packed (one row)"}


def train_markdown(results: dict) -> str:
    rows = results.get("train") or []
    if not rows and "train" not in (results.get("sections") or []):
        return ""
    first = rows[0] if rows else {}
    model = (f" ({first.get('preset')}, {first.get('layers')} layers, hidden {first.get('hidden')}, vocab "
             f"{first.get('vocab')}, {first.get('dtype')})" if rows else "")
    out = [f"\n## Training step{model}: forward + backward, invariant vs stock\n\n"
           "One step = zero grads, forward, next-token logprobs of the scored tokens, loss = their negative mean, "
           "backward (no optimizer step). stock = HF `sdpa` + torch linear, fp32 `log_softmax` of the full logits "
           "and gather (as TRL's `selective_log_softmax`); invariant = `make_invariant` + "
           "`training.token_logprobs`. tok/s = real tokens / step time; time ratio = invariant / stock. "
           "Mismatch = max |logprob of sample 0 inside the training batch − the same sample alone| over its "
           "tokens (the trainer-vs-sampler gap RL importance ratios see); bitwise = `torch.equal`.\n"]
    out.append(table(rows, [
        ("layout", "_layout"), ("batch", "batch"), ("seq", "seq"), ("tokens", "tokens"),
        ("stock tok/s", "stock_tokens_per_s"), ("invariant tok/s", "invariant_tokens_per_s"), ("time ratio", "ratio"),
        ("stock peak GB", "stock_peak_gb"), ("invariant peak GB", "invariant_peak_gb"),
        ("stock mismatch", "stock_logprob_max_abs_diff"), ("stock bitwise", "stock_logprob_bitwise_equal"),
        ("invariant mismatch", "invariant_logprob_max_abs_diff"),
        ("invariant bitwise", "invariant_logprob_bitwise_equal")]))
    return "\n".join(out)


def moe_markdown(results: dict) -> str:
    rows = results.get("moe") or []
    if not rows and "moe" not in (results.get("sections") or []):
        return ""
    first = rows[0] if rows else {}
    layer = (f" (hidden {first.get('hidden')}, {first.get('experts')} experts, top-{first.get('top_k')}, expert "
             f"intermediate {first.get('intermediate')}, {first.get('dtype')})" if rows else "")
    out = [f"\n## One MoE layer{layer}: invariant vs stock experts implementations\n\n"
           "transformers' `Qwen3MoeSparseMoeBlock`, random weights, one forward over T tokens. stock = the stock "
           "router with `config._experts_implementation` = eager / batched_mm / grouped_mm; invariant = the router on "
           "the invariant linear, row-wise routing, the experts on the invariant kernels, the top-k outputs summed "
           "in rank order in fp32; invariant_fp8 = the same with the experts in fp8 128x128 blocks (as `FP8Experts` runs). "
           "time ratio = invariant time / this implementation's time (above 1 = invariant slower; for invariant_fp8: "
           "its time / invariant's). Alone: tokens 0, T/2 and T-1 each run alone vs their rows in the batch (bitwise = "
           "`torch.equal`); Δ eager = max |output − stock eager's|.\n"]
    out.append(table(rows, [
        ("T", "tokens"), ("implementation", "implementation"), ("ms", "ms"), ("tok/s", "tokens_per_s"),
        ("time ratio", "invariant_time_ratio"), ("alone bitwise", "alone_bitwise_equal"),
        ("alone max abs Δ", "alone_max_abs_diff"), ("Δ eager", "max_abs_diff_to_eager"), ("skipped", "skipped")]))
    return "\n".join(out)


def gdn_markdown(results: dict) -> str:
    rows = results.get("gdn") or []
    if not rows and "gdn" not in (results.get("sections") or []):
        return ""
    first = rows[0] if rows else {}
    heads = (f" ({first.get('key_heads')} key heads, {first.get('value_heads')} value heads of {first.get('head_dim')}, "
             "bf16)" if rows else "")
    out = [f"\n## Gated DeltaNet scan{heads}: invariant vs stock torch and fla\n\n"
           "prefill: T tokens of one sequence from an empty state (invariant chunked kernel; transformers' "
           "`torch_chunk_gated_delta_rule`; fla's `chunk_gated_delta_rule`). decode: B sequences of T tokens take "
           "their last one (invariant: the rows since the last chunk boundary with the new one; stock "
           "`torch_recurrent_gated_delta_rule`; fla's `fused_recurrent_gated_delta_rule`). time ratio = invariant "
           "time / this implementation's (above 1 = invariant slower). decode = prefill: the decode output equals "
           "that token's row of one prefill over the whole context (`torch.equal`); Δ stock = max |output − stock "
           "torch's|.\n"]
    out.append(table(rows, [
        ("case", "case"), ("B", "sequences"), ("T", "tokens"), ("implementation", "implementation"), ("ms", "ms"),
        ("tok/s", "tokens_per_s"), ("time ratio", "invariant_time_ratio"), ("Δ stock", "max_abs_diff_to_stock"),
        ("decode = prefill", "decode_equals_prefill"), ("skipped", "skipped")]))
    if results.get("gdn_prefill") or results.get("gdn_decode"):
        model = (results.get("gdn_prefill") or results.get("gdn_decode"))[0].get("preset")
        out.append(f"\n### End to end, a Qwen3.5 model ({model}): prefill (one forward over batch × seq tokens) "
                   "and greedy decode (generate; tokens/s of the steps after prefill), stock vs invariant\n")
        out.append(table(results.get("gdn_prefill"), [
            ("batch", "batch"), ("seq", "seq"), ("layers", "layers"), ("stock tok/s", "stock_tokens_per_s"),
            ("invariant tok/s", "invariant_tokens_per_s"), ("time ratio", "ratio"),
            ("stock peak GB", "stock_peak_gb"), ("invariant peak GB", "invariant_peak_gb"),
            ("last-token max abs Δ", "last_token_max_abs_diff")]))
        out.append("\n")
        out.append(table(results.get("gdn_decode"), [
            ("batch", "batch"), ("prompt", "prompt"), ("new tokens", "new_tokens"), ("layers", "layers"),
            ("stock tok/s", "stock_decode_tokens_per_s"), ("invariant tok/s", "invariant_decode_tokens_per_s"),
            ("stock/invariant", "ratio")]))
    return "\n".join(out)


def quant_markdown(results: dict) -> str:
    rows = results.get("quant") or []
    if not rows and "quant" not in (results.get("sections") or []):
        return ""
    out = ["\n## Quantized GEMMs: invariant vs stock FP8 / int4\n\n"
           "Weights compressed by compressed-tensors (FP8_BLOCK, FP8_DYNAMIC per channel, W4A16). ratio = invariant "
           "ms / stock ms (above 1 = invariant slower); bytes = the compressed weight and scales / bf16's; alone "
           "bitwise: rows 0, M/2 and M-1 alone vs in the batch (`torch.equal`).\n"]
    out.append(table(rows, [
        ("model", "model"), ("shape", "shape"), ("format", "format"), ("M", "M"), ("N", "N"), ("K", "K"),
        ("stock", "stock"), ("invariant ms", "invariant_ms"), ("stock ms", "stock_ms"), ("ratio", "ratio"),
        ("÷ bf16", "ratio_to_bf16"), ("bytes / bf16", "bytes_ratio"),
        ("alone bitwise (invariant)", "invariant_alone_bitwise_equal"),
        ("alone bitwise (stock)", "stock_alone_bitwise_equal"), ("skipped", "skipped")]))
    return "\n".join(out)


def tensor_parallel_markdown(results: dict) -> str:
    if not results.get("tp_exchange") and not results.get("tp_steps"):
        return ""
    out = ["\n## Tensor parallelism: bytes of the row-parallel exchange, and step time at TP 1 vs TP t\n\n"
           "On paper, per token and rank, for each row-parallel layer: ours = a ring all-gather of the K tree's "
           "fp32 leaf sums, (t-1)/t x leaves x N x 4 bytes; stock = a ring all-reduce in bf16, 2 (t-1)/t x N x 2 "
           "bytes; model = x decoder layers.\n"]
    out.append(table(results.get("tp_exchange"), [
        ("preset", "preset"), ("TP", "tp"), ("layer", "layer"), ("N", "N"), ("K", "K"), ("leaves", "leaves"),
        ("ours B/token", "ours_bytes_per_token"), ("stock bf16 B/token", "stock_bf16_bytes_per_token"),
        ("ours / stock", "ratio"), ("ours B/token, model", "ours_bytes_per_token_model")]))
    out.append("\nMeasured: one engine per size on the same checkpoint and requests (greedy); step times on rank "
               "0; ratio = TP t's time / TP 1's; bitwise = every token and logprob equal to TP 1's.\n")
    out.append(table(results.get("tp_steps"), [
        ("TP", "tp"), ("requests", "requests"), ("prompt", "prompt_tokens"), ("decode", "decode_tokens"),
        ("prefill step ms", "prefill_step_ms"), ("decode step ms", "decode_step_ms"),
        ("prefill ratio", "prefill_ratio_to_tp1"), ("decode ratio", "decode_ratio_to_tp1"),
        ("bitwise = TP 1", "bitwise_equal_to_tp1"), ("dtype", "dtype")]))
    return "\n".join(out)


def spec_markdown(results: dict) -> str:
    if not results.get("spec"):
        return ""
    out = ["\n## Speculative decoding: target forwards and time with and without speculation\n\n"
           "Same weights, prompts and greedy requests; acceptance = 1 + accepted / verify steps; speedup = "
           "tokens/s with speculation / without; bitwise = every token and logprob equal to plain decoding's.\n"]
    rows = [dict(row, speculative="on" if row["speculative"] else "off") for row in results["spec"]]
    out.append(table(rows, [
        ("workload", "workload"), ("method", "method"), ("batch", "batch"), ("k", "k"), ("speculation", "speculative"),
        ("target forwards", "target_forwards"), ("forwards / token", "forwards_per_token"),
        ("acceptance", "acceptance_length"), ("draft forwards", "draft_forwards"), ("tok/s", "tokens_per_s"),
        ("speedup", "speedup"), ("bitwise", "bitwise_equal")]))
    return "\n".join(out)


def _preset(row: dict) -> str:
    return f"{row['preset']} " if row.get("preset") else ""


def decorate(results: dict) -> None:
    """Display-only helper keys (prefixed with _), used by the markdown tables."""
    for row in results.get("divergence") or []:
        row["_model"] = (_preset(row) + f"{row.get('layers')}L h{row.get('hidden')}/{row.get('intermediate')} "
                         f"v{row.get('vocab')}")
        for mode in ("stock", "invariant"):
            checked = row.get(f"{mode}_rows_checked")
            row[f"_{mode}_rows"] = f"{row[f'{mode}_rows_unequal']}/{checked}" if checked else "not run"
    for row in results.get("e2e") or []:
        row["_model"] = _preset(row) + f"{row.get('layers')}L h{row.get('hidden')}"
    for row in results.get("scoring_memory") or []:
        for name in ("naive", "ours"):
            gb = row.get(f"{name}_peak_gb")
            row[f"_{name}_peak_mb"] = row.get(f"{name}_skipped") or (gb * 1e3 if gb is not None else None)
        mismatches = row.get("is_argmax_mismatches")
        row["_argmax"] = (None if mismatches is None else
                          "yes" if mismatches == 0 else f"**no** ({mismatches}/{row.get('tokens')} rows)")
    for row in results.get("scoring_throughput") or []:
        row["_model"] = _preset(row) + f"{row.get('layers')}L h{row.get('hidden')} v{row.get('vocab')}"
        row["_lengths"] = f"{row.get('min_len')}–{row.get('max_len')}"
        row["_budget"] = f"{row.get('max_batch_tokens')} ({row.get('batches')})"
        row["_alt_budget"] = f"{row.get('alt_max_batch_tokens')} ({row.get('alt_batches')})"
    for row in results.get("engine") or []:
        row["_mode"] = ENGINE_MODES.get(row.get("mode"), row.get("mode"))
        checked = row.get("invariant_rows_checked")
        row["_alone"] = (f"{row.get('invariant_rows_equal')}/{checked}" if checked else
                         "alone by construction" if row.get("mode") == "invariant_engine" and
                         row.get("concurrency") == 1 else None)
    for row in results.get("server") or []:
        row["_mode"] = SERVER_MODES.get(row.get("mode"), row.get("mode"))
        checked = row.get("invariant_rows_checked")
        row["_alone"] = (f"{row.get('invariant_rows_equal')}/{checked}" if checked else
                         "alone by construction" if row.get("mode") == "invariant" and
                         row.get("concurrency") == 1 else None)
    for row in results.get("train") or []:
        row["_layout"] = TRAIN_LAYOUTS.get(row.get("layout"), row.get("layout"))
    for row in (results.get("attention") or []) + (results.get("decode_attention") or []):
        row["_heads"] = f"{row.get('heads')}/{row.get('kv_heads')}/{row.get('head_dim')}"
