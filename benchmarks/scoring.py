"""Scoring: (1) logprobs from final hidden states, the naive way (full fp32 [T x V] logits,
``torch.log_softmax``, gather) vs ``token_logprobs_from_hidden`` (lm_head on row chunks through the
invariant linear, each chunk reduced at once by the ``token_logprobs`` kernel): peak memory, time,
max |Δ logprob|, is-argmax agreement, at the preset's hidden size and vocabulary; (2)
``score_sequences`` tokens/s on the e2e model (the preset; quick: the family's ``tiny`` preset) vs
the stock way (HF forward on right-padded batches, log_softmax over the full logits, gather), and
whether its digests are equal for two different ``max_batch_tokens``."""
from __future__ import annotations

import torch

from invariant_infer import make_invariant, restore
from invariant_infer.model.padding import pad_sequences
from invariant_infer.scoring.core import (LOGITS_CHUNK_ELEMENTS, naive_token_logprobs, plan_batches, score_sequences,
                                     token_logprobs_from_hidden)

from .e2e import build_model, preset_config
from .matmul import DEFAULT_FAMILY, DEFAULT_PRESET
from .timing import Run, free_memory, peak_gb, reset_peak, time_ms

# Logprob memory: final hidden [T, H] and lm_head [V, H]: the preset's (H, V); quick: the family's
# tiny hidden size and this vocabulary.
QUICK_MEMORY_VOCAB = 2048
MEMORY_TOKENS, QUICK_MEMORY_TOKENS = (512, 4096, 16384), (64, 256)
QUICK_CHUNK_ROWS = 64  # the default chunk (32 Mi elements) would hold a whole tiny batch: force several chunks
MAX_FREE_FRACTION = 0.6  # skip a path whose estimated peak exceeds this share of free GPU memory
# Scoring throughput: (sequences, min length, max length, max_batch_tokens, a second budget for the digest check)
THROUGHPUT, QUICK_THROUGHPUT = (64, 128, 1024, 16384, 4096), (8, 8, 24, 256, 48)


def _gb(nbytes: float) -> float:
    return nbytes / 1e9


def naive_estimate_bytes(tokens: int, vocab: int) -> int:
    """Peak above the inputs of ``naive_token_logprobs``: the fp32 logits and the fp32 log_softmax
    alive together (the model-dtype linear output is freed once ``.float()`` has copied it)."""
    return tokens * vocab * (4 + 4)


def ours_estimate_bytes(tokens: int, vocab: int, chunk_rows: int, dtype: torch.dtype) -> int:
    """Peak above the inputs of ``token_logprobs_from_hidden``: one [chunk_rows x V] logits chunk in the
    model dtype, plus the [T] fp32 logprobs / bool outputs and one chunk's kernel outputs. Excludes the
    fp32 split-K workspace the linear uses on GPU only when the output tiles are too few (small chunks)."""
    rows = min(chunk_rows, tokens)
    return rows * vocab * torch.finfo(dtype).bits // 8 + tokens * 5 + rows * (4 + 4 + 8 + 1)


def _free_bytes(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free


def _measure_peak(ctx: Run, fn):
    """(result, peak GB above what was allocated before the call); peak None on CPU."""
    if not ctx.on_gpu:
        return fn(), None
    free_memory(ctx.device)
    torch.cuda.synchronize(ctx.device)
    base = torch.cuda.memory_allocated(ctx.device)
    reset_peak(ctx.device)
    out = fn()
    return out, peak_gb(ctx.device) - _gb(base)


def _memory(ctx: Run, hidden_size: int, vocab: int, token_counts, dtype, chunk_rows: int | None) -> list:
    gen = torch.Generator(device=ctx.device).manual_seed(11)
    weight = (torch.randn(vocab, hidden_size, generator=gen, device=ctx.device) * 0.02).to(dtype)
    chunk = chunk_rows or max(1, LOGITS_CHUNK_ELEMENTS // vocab)
    reps = 5 if ctx.on_gpu else 1
    rows = []
    for tokens in token_counts:
        item = f"logprob memory T={tokens}"
        if ctx.out_of_time(item):
            continue
        try:
            hidden = torch.randn(tokens, hidden_size, generator=gen, device=ctx.device).to(dtype)
            targets = torch.randint(0, vocab, (tokens,), generator=gen, device=ctx.device)
            # Every other target is the stock argmax, so the is-argmax flags are not all False.
            for start in range(0, tokens, 2048):
                logits = torch.nn.functional.linear(hidden[start:start + 2048:2], weight)
                targets[start:start + 2048:2] = logits.argmax(-1)
            del logits
            naive_est, ours_est = naive_estimate_bytes(tokens, vocab), ours_estimate_bytes(tokens, vocab, chunk, dtype)
            row = {"tokens": tokens, "hidden": hidden_size, "vocab": vocab, "dtype": str(dtype)[6:],
                   "chunk_rows": chunk, "naive_estimate_gb": _gb(naive_est), "ours_estimate_gb": _gb(ours_est),
                   "peak_gb_method": "measured" if ctx.on_gpu else "estimate", "naive_skipped": None}
            naive = lambda: naive_token_logprobs(hidden, weight, targets)  # noqa: E731
            ours = lambda: token_logprobs_from_hidden(hidden, weight, targets, chunk_rows=chunk)  # noqa: E731
            free = _free_bytes(ctx.device)
            results = {}
            for name, fn, est in (("naive", naive, naive_est), ("ours", ours, ours_est)):
                if free is not None and est > MAX_FREE_FRACTION * free:
                    reason = f"skipped: would need {_gb(est):.3g} GB (free {_gb(free):.3g} GB)"
                    row[f"{name}_skipped"] = reason
                    ctx.skipped.append({"section": ctx.section, "item": f"{item} {name}", "reason": reason})
                    row.update({f"{name}_peak_gb": None, f"{name}_ms": None})
                    continue
                fn()  # warm-up: compiles the kernels (GPU), first-call overheads (CPU)
                results[name], peak = _measure_peak(ctx, fn)
                row[f"{name}_peak_gb"] = peak if ctx.on_gpu else _gb(est)
                row[f"{name}_ms"] = time_ms(fn, ctx.device, reps=reps, warmup=0)
            row.setdefault("ours_skipped", None)
            if "naive" in results and "ours" in results:
                (lp_n, am_n), (lp_o, am_o) = results["naive"], results["ours"]
                row["max_abs_diff"] = (lp_n - lp_o).abs().max().item()
                row["argmax_targets"] = int(am_n.sum().item())
                row["is_argmax_mismatches"] = int((am_n != am_o).sum().item())
                row["is_argmax_agree"] = row["is_argmax_mismatches"] == 0
            else:
                row.update({"max_abs_diff": None, "argmax_targets": None, "is_argmax_mismatches": None,
                            "is_argmax_agree": None})
            if row.get("naive_peak_gb") and row.get("ours_peak_gb"):
                row["memory_ratio"] = row["naive_peak_gb"] / row["ours_peak_gb"]
            else:
                row["memory_ratio"] = None
            rows.append(row)
            del results, hidden, targets
        except Exception as exc:
            ctx.failed(item, exc)
    del weight
    free_memory(ctx.device)
    return rows


def stock_score(model, sequences, max_batch_tokens: int) -> list:
    """The stock way: the same batch plan, right-padded HF forward, log_softmax over the full fp32
    logits, gather. Returns fp32 CPU logprobs of tokens 1.. of each sequence."""
    device = model.get_output_embeddings().weight.device
    out = [None] * len(sequences)
    for batch in plan_batches([len(s) for s in sequences], max_batch_tokens):
        ids, mask = pad_sequences([sequences[i] for i in batch], side="right", pad_token_id=0, device=device)
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        del logits
        picked = logprobs[:, :-1].gather(-1, ids[:, 1:, None])[..., 0].cpu()
        del logprobs
        for r, i in enumerate(batch):
            out[i] = picked[r, :len(sequences[i]) - 1]
    return out


def _timed(ctx: Run, fn, reps: int):
    """(result of the measured pass, peak GB incl. weights or None, median ms). On GPU one warm-up
    pass first (kernel compiles); on CPU the single timed pass is the result."""
    if ctx.on_gpu:
        fn()
        reset_peak(ctx.device)
        result = fn()
        peak = peak_gb(ctx.device)
        return result, peak, time_ms(fn, ctx.device, reps=reps, warmup=0)
    box = []
    ms = time_ms(lambda: box.append(fn()), ctx.device, reps=1, warmup=0)
    return box[-1], None, ms


def _throughput(ctx: Run, config, name: str, spec, dtype) -> list:
    n_seq, lo, hi, budget, alt_budget = spec
    item = f"score_sequences {n_seq} seqs {lo}-{hi} tokens"
    if ctx.out_of_time(item):
        return []
    gen = torch.Generator().manual_seed(5)
    lengths = torch.randint(lo, hi + 1, (n_seq,), generator=gen).tolist()
    sequences = [torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    tokens = sum(lengths)
    model = build_model(ctx, config, dtype)
    row = {"sequences": n_seq, "min_len": min(lengths), "max_len": max(lengths), "tokens": tokens,
           "scored_tokens": tokens - n_seq, "max_batch_tokens": budget, "alt_max_batch_tokens": alt_budget,
           "batches": len(plan_batches(lengths, budget)), "preset": name, "layers": config.num_hidden_layers,
           "hidden": config.hidden_size, "vocab": config.vocab_size, "dtype": str(dtype)[6:],
           "stock_ms": None, "invariant_ms": None, "stock_tokens_per_s": None, "invariant_tokens_per_s": None,
           "stock_peak_gb": None, "invariant_peak_gb": None, "stock_skipped": None}
    reps = 3 if ctx.on_gpu else 1
    stock = ours = None
    try:
        with torch.inference_mode():
            free = _free_bytes(ctx.device)
            # bf16 logits + fp32 copy + fp32 log_softmax of the largest batch
            est = budget * config.vocab_size * (torch.finfo(dtype).bits // 8 + 8)
            if free is not None and est > MAX_FREE_FRACTION * free:
                row["stock_skipped"] = f"skipped: would need {_gb(est):.3g} GB (free {_gb(free):.3g} GB)"
                ctx.skipped.append({"section": ctx.section, "item": f"{item} stock", "reason": row["stock_skipped"]})
            else:
                try:
                    stock, row["stock_peak_gb"], row["stock_ms"] = _timed(
                        ctx, lambda: stock_score(model, sequences, budget), reps)
                except Exception as exc:
                    ctx.failed(f"{item} stock", exc)
                free_memory(ctx.device)
            make_invariant(model)
            try:
                ours, row["invariant_peak_gb"], row["invariant_ms"] = _timed(
                    ctx, lambda: score_sequences(model, sequences, max_batch_tokens=budget), reps)
                other = score_sequences(model, sequences, max_batch_tokens=alt_budget)
                row["alt_batches"] = len(plan_batches(lengths, alt_budget))
                row["digests_equal_across_budgets"] = [r.digest for r in ours] == [r.digest for r in other]
            finally:
                restore(model)
    except Exception as exc:
        ctx.failed(item, exc)
    finally:
        del model
        free_memory(ctx.device)
    row.setdefault("alt_batches", len(plan_batches(lengths, alt_budget)))
    row.setdefault("digests_equal_across_budgets", None)
    for mode in ("stock", "invariant"):
        if row[f"{mode}_ms"]:
            row[f"{mode}_tokens_per_s"] = tokens / (row[f"{mode}_ms"] * 1e-3)
    row["ratio"] = row["invariant_ms"] / row["stock_ms"] if row["invariant_ms"] and row["stock_ms"] else None
    row["max_abs_diff"] = (max((a - b.token_logprobs).abs().max().item() for a, b in zip(stock, ours))
                           if stock is not None and ours is not None else None)
    return [row]


def run(ctx: Run, config=None, memory_shape=None, memory_tokens=None, throughput=None,
        dtype=torch.bfloat16, family: str = DEFAULT_FAMILY, preset: str = DEFAULT_PRESET) -> dict:
    config, name = preset_config(family, "tiny" if ctx.quick else preset, config)
    if memory_shape is None:
        memory_shape = (config.hidden_size, QUICK_MEMORY_VOCAB if ctx.quick else config.vocab_size)
    hidden_size, vocab = memory_shape
    memory_tokens = memory_tokens or (QUICK_MEMORY_TOKENS if ctx.quick else MEMORY_TOKENS)
    chunk_rows = QUICK_CHUNK_ROWS if ctx.quick else None
    memory = _memory(ctx, hidden_size, vocab, memory_tokens, dtype, chunk_rows)
    try:  # a failure here (e.g. building the model) keeps the memory rows
        rows = _throughput(ctx, config, name, throughput or (QUICK_THROUGHPUT if ctx.quick else THROUGHPUT), dtype)
    except Exception as exc:
        ctx.failed("score_sequences throughput", exc)
        rows = []
    return {"scoring_memory": memory, "scoring_throughput": rows}
