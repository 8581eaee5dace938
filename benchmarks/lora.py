"""LoRA adapters: multi-LoRA engine prefill and decode throughput against the base model, and PEFT's own
(stock, unpatched) forward against the stock base forward, at 1, 4 and 16 adapters of rank 16.

Rows (``lora``), one per mode, phase and adapter count (0: the base model, no adapters):

* ``engine``: ``Engine(model)`` for the base model (built first: slots stay on a model's projections),
  then ``Engine(model, max_loras=16, max_lora_rank=16)`` holding all the adapters. ``requests`` prompts are
  added at once and assigned to the adapters round-robin (request i: adapter i mod n); prefix caching is
  off, so that the same prompts run again are prefilled again. The first step
  prefills every prompt (``prefill``: prompt tokens / that step's time); the remaining steps decode
  (``decode``: the tokens they produce / their time). ``time_ratio_to_base`` = the base row's tokens/s ÷
  this row's (the goal on a GPU: at most 1.10 at 4 adapters). Bits: the batch runs once more, untimed,
  with prompt logprobs (a sampled token's logprob alone can hide a changed low bit of the hidden
  states), and ``bitwise_rows_checked`` of its requests run again alone (one request in flight) on the
  same engine: tokens, logprobs and prompt logprobs compared with ``==`` (``bitwise_rows_equal``).
* ``peft_forward``: a ``PeftModel`` (``get_peft_model`` on a second copy of the same random weights,
  never patched) holding the same adapters; one forward of ``requests`` prompts of one length with
  ``adapter_names`` per row (PEFT's mixed-batch path, round-robin as above); adapters 0: the same forward
  under ``disable_adapter()``, which is the stock base model. Phase ``prefill`` only.

Quick (CPU, the Triton interpreter): the ``tiny`` preset, 1 and 2 adapters of rank 4, 2 requests of 8
tokens, 2 new tokens; only the bits mean anything there.
"""
from __future__ import annotations

import time

import torch

from invariant_infer.engine import Engine, SamplingParams

from .e2e import build_model, preset_config
from .engine import kv_cache_bytes, random_prompts
from .matmul import DEFAULT_FAMILY, DEFAULT_PRESET
from .timing import Run, _sync, free_memory, time_ms

ADAPTERS, QUICK_ADAPTERS = (1, 4, 16), (1, 2)
RANK, QUICK_RANK = 16, 4
REQUESTS, QUICK_REQUESTS = 32, 2
PROMPT_TOKENS, QUICK_PROMPT_TOKENS = 128, 8
MAX_TOKENS, QUICK_MAX_TOKENS = 32, 2
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPT_SEED, ADAPTER_SEED = 6, 200


def check_indices(requests: int, quick: bool) -> list[int]:
    """Requests run again alone: all of them (quick), else the first, middle and last."""
    return list(range(requests)) if quick else sorted({0, requests // 2, requests - 1})


def peft_adapters(ctx: Run, config, dtype, count: int, rank: int):
    """A stock PeftModel on a fresh copy of the random weights with adapters ``a0`` .. ``a{count-1}``
    (random nonzero A and B, seeded per adapter), and name -> (LoraConfig, state dict) for the engine."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    model = build_model(ctx, config, dtype).eval()
    sources, peft_model = {}, None
    for i in range(count):
        name, lora = f"a{i}", LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, init_lora_weights=False)
        torch.manual_seed(ADAPTER_SEED + i)
        if peft_model is None:
            peft_model = get_peft_model(model, lora, adapter_name=name)
        else:
            peft_model.add_adapter(name, lora)
        sources[name] = (lora, get_peft_model_state_dict(peft_model, adapter_name=name))
    return peft_model.eval(), sources


def outcome(out) -> tuple:
    return out.token_ids, out.logprobs, out.prompt_logprobs


def engine_rows(engine: Engine, prompts, params, names, device) -> tuple[list, float, float]:
    """(outputs in prompt order, prefill seconds (the first step), decode seconds (the other steps))."""
    ids = [engine.add_request(p, params, lora=name) for p, name in zip(prompts, names)]
    done, step_times = {}, []
    while len(done) < len(ids):
        _sync(device)
        start = time.perf_counter()
        outputs = engine.step()
        _sync(device)
        step_times.append(time.perf_counter() - start)
        done.update({o.request_id: o for o in outputs if o.finished})
    return [done[i] for i in ids], step_times[0], sum(step_times[1:])


def bitwise_rows(engine: Engine, prompts, names, max_tokens: int, checked, alone: dict, device) -> int:
    """How many of the ``checked`` requests of the batch (untimed, with prompt logprobs: a sampled token's
    logprob alone can hide a changed low bit of the hidden states) equal the request run alone on the same
    engine. ``alone`` caches (prompt index, adapter) -> the outcome alone."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, prompt_logprobs=0)
    batch, _, _ = engine_rows(engine, prompts, params, names, device)
    for i in checked:
        if (i, names[i]) not in alone:
            (out,), _, _ = engine_rows(engine, [prompts[i]], params, [names[i]], device)
            alone[(i, names[i])] = outcome(out)
    return sum(outcome(batch[i]) == alone[(i, names[i])] for i in checked)


def measure_engine(ctx: Run, engine: Engine, prompts, params, names) -> tuple[list, dict]:
    if ctx.on_gpu:  # warm-up: compiles the kernels for the prefill and decode shapes
        engine_rows(engine, prompts, SamplingParams(max_tokens=2, ignore_eos=True), names, ctx.device)
    outputs, prefill_s, decode_s = engine_rows(engine, prompts, params, names, ctx.device)
    assert all(len(o.token_ids) == params.max_tokens for o in outputs), "every request runs to max_tokens"
    prompt_tokens = sum(map(len, prompts))
    decode_tokens = sum(len(o.token_ids) - 1 for o in outputs)  # the prefill step samples each first token
    return outputs, {"prefill": (prompt_tokens, prefill_s), "decode": (decode_tokens, decode_s)}


def run(ctx: Run, config=None, dtype=torch.bfloat16, family: str = DEFAULT_FAMILY,
        preset: str = DEFAULT_PRESET, counts=None) -> dict:
    config, name = preset_config(family, "tiny" if ctx.quick else preset, config)
    counts = counts or (QUICK_ADAPTERS if ctx.quick else ADAPTERS)
    rank = QUICK_RANK if ctx.quick else RANK
    requests = QUICK_REQUESTS if ctx.quick else REQUESTS
    prompt_tokens = QUICK_PROMPT_TOKENS if ctx.quick else PROMPT_TOKENS
    max_tokens = QUICK_MAX_TOKENS if ctx.quick else MAX_TOKENS
    prompts = random_prompts(requests, (prompt_tokens, prompt_tokens), config.vocab_size, PROMPT_SEED)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    kv_bytes = kv_cache_bytes(config, ctx.device, dtype, requests, prompt_tokens + max_tokens)
    options = {"max_num_seqs": requests, "max_num_batched_tokens": max(2048, requests * prompt_tokens),
               "kv_cache_memory": kv_bytes, "enable_prefix_caching": False}  # every run prefills every prompt
    shared = {"preset": name, "dtype": str(dtype)[6:], "rank": rank, "requests": requests,
              "prompt_tokens": prompt_tokens, "max_tokens": max_tokens}
    rows, base = [], {}

    def add(mode, phase, adapters, tokens, seconds, checked=None, equal=None):
        tokens_per_s = tokens / max(seconds, 1e-9)
        if adapters == 0:
            base[(mode, phase)] = tokens_per_s
        ratio = base[(mode, phase)] / tokens_per_s if (mode, phase) in base else None
        rows.append({"mode": mode, "phase": phase, "adapters": adapters, **shared, "tokens": tokens,
                     "elapsed_s": seconds, "tokens_per_s": tokens_per_s, "time_ratio_to_base": ratio,
                     "bitwise_rows_checked": checked, "bitwise_rows_equal": equal})

    model = build_model(ctx, config, dtype)
    peft_model, sources = peft_adapters(ctx, config, dtype, max(counts), rank)
    if not ctx.out_of_time("lora engine adapters=0"):
        try:
            _, phases = measure_engine(ctx, Engine(model, **options), prompts, params, [None] * requests)
            for phase, (tokens, seconds) in phases.items():
                add("engine", phase, 0, tokens, seconds)
        except Exception as exc:
            ctx.failed("lora engine adapters=0", exc)
    engine = Engine(model, max_loras=max(counts), max_lora_rank=rank, **options)
    for adapter, source in sources.items():
        engine.add_lora(adapter, source)
    alone = {}  # (prompt index, adapter) -> (token ids, logprobs) of that request alone
    for count in counts:
        item = f"lora engine adapters={count}"
        if ctx.out_of_time(item):
            continue
        names = [f"a{i % count}" for i in range(requests)]
        try:
            _, phases = measure_engine(ctx, engine, prompts, params, names)
            checked = check_indices(requests, ctx.quick)
            equal = bitwise_rows(engine, prompts, names, max_tokens, checked, alone, ctx.device)
        except Exception as exc:
            ctx.failed(item, exc)
            continue
        for phase, (tokens, seconds) in phases.items():
            add("engine", phase, count, tokens, seconds, len(checked), equal)
    del engine, model
    free_memory(ctx.device)
    ids = torch.tensor(prompts, device=ctx.device)
    reps, warmup = (10, 2) if ctx.on_gpu else (1, 0)  # CPU: the forwards' outputs are not needed, nor their times
    for count in (0, *counts):
        item = f"lora peft_forward adapters={count}"
        if ctx.out_of_time(item):
            continue
        try:
            with torch.no_grad():
                if count == 0:
                    with peft_model.disable_adapter():
                        ms = time_ms(lambda: peft_model(input_ids=ids), ctx.device, reps, warmup)
                else:
                    names = [f"a{i % count}" for i in range(requests)]
                    ms = time_ms(lambda: peft_model(input_ids=ids, adapter_names=names), ctx.device, reps,
                                 warmup)
        except Exception as exc:
            ctx.failed(item, exc)
            continue
        add("peft_forward", "prefill", count, ids.numel(), ms / 1e3)
    del peft_model
    free_memory(ctx.device)
    return {"lora": rows}
