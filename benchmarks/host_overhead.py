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
decode steps, each advancing every request by one token (checked). The host phases run the same
code in both engines except that the stock one takes the sampled tokens' logprobs with torch and
attends sequence by sequence.

Forward ``"stand-in"`` (the stock engine, every device): the runner's forward returns random hidden
states of the step's shape instead of running the model, so only the host path runs. On CPU a real
forward runs on the cores that then run the next step's Python, and its working set (hundreds of MB
of KV at 8,192 tokens) evicts the host path's data from the CPU caches: measured, a stand-in forward
that only touches 256 MB doubled the host phases of 32 sequences at 8 tokens, to what a real
forward at 8,192 tokens gives. A GPU's forward leaves the host's caches alone; the stand-in rows
are the host path's own cost at each length."""
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
# The stock engine with its forward stood in for (see the module's docstring): every length, quick too
# (no model runs, so a prefill of 64 x 8,192 tokens costs only its host work).
STAND_IN_RUNNING, QUICK_STAND_IN_RUNNING = RUNNING, (64,)
PREFILL_TOKENS_PER_STEP = 65536
PROMPT_SEED = 5
# On CPU the section runs with one torch thread: on a shared CPU, waking torch's intra-op pool adds
# milliseconds to a small batched op (measured: a [64, 512] argmax took 9 ms with 2 threads, 71 µs
# with 1), time a GPU run's host side does not have.
CPU_THREADS = 1


def stand_in_forward(runner, hidden_size: int, seed: int = 0):
    """A forward for ``runner`` that returns random hidden states [T, H] of the step's real tokens."""
    generator = torch.Generator(runner.device).manual_seed(seed)

    def forward(inputs):
        hidden = torch.randn(inputs.num_real_tokens, hidden_size, generator=generator, device=runner.device)
        return hidden.to(runner.dtype)
    return forward


def measure(model, kernels: str, running: int, context: int, steps: int, warmup: int, device: torch.device,
            forward: str = "model") -> dict:
    """Per-phase microseconds per decode step with ``running`` sequences of ``context`` tokens in flight;
    ``forward="stand-in"`` replaces the model's forward (see the module's docstring)."""
    config = model.config
    budget = min(max(2048, running * context), PREFILL_TOKENS_PER_STEP)
    # The first token, one per prefill step after it (the first requests decode while later ones
    # prefill), the untimed decode steps and the timed ones.
    max_tokens = 1 + -(-running * context // budget) + warmup + steps
    engine = Engine(model, max_num_seqs=running, max_num_batched_tokens=budget,
                    kv_cache_memory=kv_cache_bytes(config, device, model.dtype, running, context + max_tokens),
                    kernels=kernels)
    if forward == "stand-in":
        engine.core.runner.forward = stand_in_forward(engine.core.runner, config.hidden_size)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    for prompt in random_prompts(running, (context, context), config.vocab_size, PROMPT_SEED):
        engine.add_request(prompt, params)
    first = set()
    while len(first) < running:  # prefill: every request's first token
        first.update(out.request_id for out in engine.step())
    for _ in range(warmup):
        if len(engine.step()) != running:
            raise RuntimeError(f"expected all {running} sequences to advance together")
    engine.core.timer = timer = StepTimer(device)
    for _ in range(steps):
        outputs = engine.step()
        if len(outputs) != running or any(len(o.token_ids) != 1 for o in outputs):
            raise RuntimeError(f"a timed step advanced {len(outputs)} of {running} sequences")
    engine.core.timer = None
    per_step = timer.per_step_us()
    host = sum(per_step[p] for p in HOST_PHASES)  # medians per phase, summed
    device_us = sum(per_step[p] for p in DEVICE_PHASES)
    return {"kernels": kernels, "forward": forward, "running": running, "context": context, "steps": steps,
            "warmup_steps": warmup,
            **{f"{p}_us": per_step[p] for p in PHASES}, **{f"{p}_us_per_seq": per_step[p] / running for p in HOST_PHASES},
            "host_us": host, "device_us": device_us, "host_us_per_seq": host / running,
            "host_fraction": host / (host + device_us) if host + device_us else None}


def run(ctx: Run, config=None, running: dict | None = None, steps=None, dtype=torch.bfloat16, family: str = DEFAULT_FAMILY,
        preset: str = "tiny") -> dict:
    # A tiny model whatever the suite's preset (taken as every section takes it): the point is the
    # engine's time, not the model's.
    config, name = preset_config(family, "tiny", config, **(QUICK_OVERRIDES if ctx.quick else {}))
    config.max_position_embeddings = max(config.max_position_embeddings, max(CONTEXTS) + 64)
    items = plan(ctx, running)
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
        rows = _measure_all(ctx, model, items, steps, warmup, info)
    finally:
        torch.set_num_threads(threads)
    del model
    free_memory(ctx.device)
    return {"host_overhead": rows}


def plan(ctx: Run, running: dict | None = None) -> list[tuple[str, str, int, int]]:
    """(kernels, forward, running, context) of each measurement, in order: the stand-in forward first,
    then the stock engine, then the invariant one. On CPU the model's forward runs at the quick
    contexts in full mode too (the stock one's attention over 256 x 8,192 tokens takes most of an
    hour on one thread; the stand-in rows cover every length), and the invariant engine at the quick
    sizes: its forward is interpreted, and its host phases are the stock engine's code."""
    if ctx.quick:
        running, contexts = running or QUICK_RUNNING, QUICK_CONTEXTS
        stand_in = QUICK_STAND_IN_RUNNING
    else:
        running, contexts = running or dict.fromkeys(KERNELS, RUNNING), dict.fromkeys(KERNELS, CONTEXTS)
        stand_in = STAND_IN_RUNNING
        if not ctx.on_gpu:
            running, contexts = {**running, "invariant": QUICK_RUNNING["invariant"]}, QUICK_CONTEXTS
    items = [("stock", "stand-in", n, c) for n in stand_in for c in CONTEXTS]
    return items + [(k, "model", n, c) for k in KERNELS for n in running[k] for c in contexts[k]]


def _measure_all(ctx: Run, model, items: list, steps: int, warmup: int, info: dict) -> list:
    rows = []
    for kernels in KERNELS:  # stock first: the invariant engine wraps the model (restored below)
        try:
            for _, forward, count, context in [item for item in items if item[0] == kernels]:
                item = f"host overhead {kernels} forward={forward} running={count} context={context}"
                if ctx.out_of_time(item):
                    continue
                try:
                    rows.append({**measure(model, kernels, count, context, steps, warmup, ctx.device, forward),
                                 **info})
                except Exception as exc:
                    ctx.failed(item, exc)
                free_memory(ctx.device)
        finally:
            restore(model)
            model.set_attn_implementation("sdpa")
    return rows
