"""Engine host overhead: the engine's own time per decode step, everything but the model's
forward, at 1, 64 and 256 running sequences of a tiny model and 16, 1,024 and 8,192 tokens so far
per sequence, in microseconds per step, per phase (the median of the timed steps), and per sequence.

Phases (``invariant_infer.engine.step_timer``): schedule (``Scheduler.schedule``), metadata
(packing tokens, positions, slots and block tables into the runner's buffers), sampling (each
sequence's next token), output (logprob bookkeeping, stop checks, page registration, the
``RequestOutput`` of every request that advanced); the device phases apart: forward (the model and
lm_head) and logprobs (the token-logprob kernel). On CUDA each phase boundary waits for the
device, so the device phases hold the kernels' time and the host phases the Python around them.
On CPU the device phases run through the Triton interpreter (NOT meaningful), while the host
phases are the same Python as on a GPU, so their CPU numbers are meaningful (for this CPU).

Method: for each engine (``kernels="stock"`` on the unwrapped model, then ``"invariant"``), ``running``
greedy requests (``ignore_eos``, outputs as deltas, as the server streams them) of random prompts
of ``context`` tokens, prefilled; untimed decode steps (2; quick: none); then ``steps`` timed
decode steps, each advancing every request by one token (checked). The host phases run the same code in both engines except that the stock one takes
the sampled tokens' logprobs with torch and attends sequence by sequence."""
from __future__ import annotations

import torch

from invariant_infer import restore
from invariant_infer.engine import Engine, RequestOutputKind, SamplingParams
from invariant_infer.engine.step_timer import DEVICE_PHASES, HOST_PHASES, PHASES, StepTimer

from .e2e import build_model, preset_config
from .engine import kv_cache_bytes, random_prompts
from .matmul import DEFAULT_FAMILY
from .timing import Run, free_memory

KERNELS = ("stock", "invariant")
RUNNING, STEPS, WARMUP_STEPS = (1, 64, 256), 20, 2
# Quick (CPU, CI): 1 layer, 3 timed steps, no warm-up step; the invariant engine at up to 64 sequences
# (the interpreter's forward of 256 takes about 10 s a step), the stock one at all three.
QUICK_RUNNING = {"stock": (1, 64, 256), "invariant": (1, 64)}
QUICK_STEPS, QUICK_OVERRIDES = 3, {"num_hidden_layers": 1}
# Tokens so far per sequence (its prompt): a step's host work must not grow with them. Quick: the
# stock engine at 16 and 1,024, the invariant one at 16 (the interpreter's prefill of 64 x 1,024).
CONTEXTS = (16, 1024, 8192)
QUICK_CONTEXTS = {"stock": (16, 1024), "invariant": (16,)}
PREFILL_TOKENS_PER_STEP = 65536
PROMPT_SEED = 5
# On CPU the section runs with one torch thread: on a shared CPU, waking torch's intra-op pool adds
# milliseconds to a small batched op (measured: a [64, 512] argmax took 9 ms with 2 threads, 71 µs
# with 1), time a GPU run's host side does not have.
CPU_THREADS = 1


def measure(model, kernels: str, running: int, context: int, steps: int, warmup: int, device: torch.device) -> dict:
    """Per-phase microseconds per decode step with ``running`` sequences of ``context`` tokens in flight."""
    config = model.config
    budget = min(max(2048, running * context), PREFILL_TOKENS_PER_STEP)
    # The first token, one per prefill step after it (the first requests decode while later ones
    # prefill), the untimed decode steps and the timed ones.
    max_tokens = 1 + -(-running * context // budget) + warmup + steps
    engine = Engine(model, max_num_seqs=running, max_num_batched_tokens=budget,
                    kv_cache_memory=kv_cache_bytes(config, device, model.dtype, running, context + max_tokens),
                    kernels=kernels)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    for prompt in random_prompts(running, (context, context), config.vocab_size, PROMPT_SEED):
        engine.add_request(prompt, params)
    first = set()
    while len(first) < running:  # prefill: every request's first token
        first.update(out.request_id for out in engine.step())
    for _ in range(warmup):
        if len(engine.step()) != running:
            raise RuntimeError(f"expected all {running} sequences to advance together")
    engine.timer = timer = StepTimer(device)
    for _ in range(steps):
        outputs = engine.step()
        if len(outputs) != running or any(len(o.token_ids) != 1 for o in outputs):
            raise RuntimeError(f"a timed step advanced {len(outputs)} of {running} sequences")
    engine.timer = None
    per_step = timer.per_step_us()
    host = sum(per_step[p] for p in HOST_PHASES)  # medians per phase, summed
    device_us = sum(per_step[p] for p in DEVICE_PHASES)
    return {"kernels": kernels, "running": running, "context": context, "steps": steps, "warmup_steps": warmup,
            **{f"{p}_us": per_step[p] for p in PHASES}, **{f"{p}_us_per_seq": per_step[p] / running for p in HOST_PHASES},
            "host_us": host, "device_us": device_us, "host_us_per_seq": host / running,
            "host_fraction": host / (host + device_us) if host + device_us else None}


def run(ctx: Run, config=None, running: dict | None = None, steps=None, dtype=torch.bfloat16, family: str = DEFAULT_FAMILY,
        preset: str = "tiny") -> dict:
    # A tiny model whatever the suite's preset (taken as every section takes it): the point is the
    # engine's time, not the model's.
    config, name = preset_config(family, "tiny", config, **(QUICK_OVERRIDES if ctx.quick else {}))
    config.max_position_embeddings = max(config.max_position_embeddings, max(CONTEXTS) + 64)
    running = running or (QUICK_RUNNING if ctx.quick else dict.fromkeys(KERNELS, RUNNING))
    contexts = QUICK_CONTEXTS if ctx.quick else dict.fromkeys(KERNELS, CONTEXTS)
    steps = steps or (QUICK_STEPS if ctx.quick else STEPS)
    warmup = 0 if ctx.quick else WARMUP_STEPS
    model = build_model(ctx, config, dtype)
    info = {"preset": name, "layers": config.num_hidden_layers, "hidden": config.hidden_size,
            "vocab": config.vocab_size, "dtype": str(dtype)[6:],
            "host_meaningful": True, "device_meaningful": ctx.on_gpu,
            "torch_threads": torch.get_num_threads() if ctx.on_gpu else CPU_THREADS}
    threads = torch.get_num_threads()
    if not ctx.on_gpu:  # see CPU_THREADS
        torch.set_num_threads(CPU_THREADS)
    try:
        rows = _measure_all(ctx, model, running, contexts, steps, warmup, info)
    finally:
        torch.set_num_threads(threads)
    del model
    free_memory(ctx.device)
    return {"host_overhead": rows}


def _measure_all(ctx: Run, model, running: dict, contexts: dict, steps: int, warmup: int, info: dict) -> list:
    rows = []
    for kernels in KERNELS:  # stock first: the invariant engine wraps the model (restored below)
        try:
            for count, context in [(n, c) for n in running[kernels] for c in contexts[kernels]]:
                item = f"host overhead {kernels} running={count} context={context}"
                if ctx.out_of_time(item):
                    continue
                try:
                    rows.append({**measure(model, kernels, count, context, steps, warmup, ctx.device), **info})
                except Exception as exc:
                    ctx.failed(item, exc)
                free_memory(ctx.device)
        finally:
            restore(model)
            model.set_attn_implementation("sdpa")
    return rows
