"""Serving engine: output tokens/s, time per output token (TPOT) and time to first token (TTFT) at
several concurrencies, for three modes side by side on the same weights and prompts:

* ``invariant_engine``: ``Engine(model)`` (``make_invariant``, paged invariant attention);
* ``stock_engine``: ``Engine(model, kernels="stock")`` on the unwrapped model (stock linear layers,
  torch SDPA per sequence), the same scheduler and paged KV cache;
* ``hf_generate``: stock ``model.generate`` (unwrapped, ``attn_implementation="sdpa"``) on
  left-padded batches of ``concurrency`` prompts, one batch after the other;
* ``invariant_engine_eager`` (GPU only, last: a budget cut drops it first): the invariant engine
  with ``cuda_graphs=False``, every decode step launched kernel by kernel; ``graphs_to_eager`` on
  the invariant row is its tok/s over this one's (on CPU there are no graphs: the modes are the same).

Concurrency = requests in flight: a closed loop keeps ``concurrency`` requests in the engine
(``add_request`` as soon as one finishes, ``max_num_seqs = concurrency``); generate runs the
requests in batches of ``concurrency``. Every request is greedy with the same ``max_tokens``
(``ignore_eos``; generate: ``min_new_tokens = max_new_tokens``), so all produce the same count.

Per request: submitted (``add_request``, or the start of its generate batch), first token (the end
of the engine step that produced it; generate: a streamer's first ``put`` of new tokens) and finish.
TTFT = first token - submitted; TPOT = (finish - first token) / (tokens - 1); both means over
requests. tokens/s = all output tokens / (last finish - first submission).

The invariant engine's point is checked too: at each concurrency above 1, a few requests
(``check_indices``) are compared with the same request alone, tokens and logprobs with ``==``
(``invariant_rows_equal`` of ``invariant_rows_checked``). "Alone" is the request's output at
concurrency 1 (one request in flight, so every step ran it alone) when that level ran, else a fresh
engine running only that request."""
from __future__ import annotations

import time

import torch
from transformers.generation.streamers import BaseStreamer

from invariant_infer import restore
from invariant_infer.engine import Engine, SamplingParams
from invariant_infer.engine.kv_cache_layout import kv_cache_layout
from invariant_infer.engine.model_runner import ModelRunner
from invariant_infer.model.padding import left_pad

from .e2e import build_model, preset_config
from .matmul import DEFAULT_FAMILY, DEFAULT_PRESET
from .timing import Run, _sync, free_memory

MODES = ("invariant_engine", "stock_engine", "hf_generate", "invariant_engine_eager")
# Full suite: concurrency 1, 8, 32 with 4, 16, 64 requests (the closed loop runs 2 waves of each,
# 4 at concurrency 1), prompts of 96-160 tokens, 32 new tokens, every wave's prefill in one step.
CONCURRENCY, REQUESTS = (1, 8, 32), (4, 16, 64)
PROMPT_LENS, MAX_TOKENS, MAX_BATCHED_TOKENS = (96, 160), 32, 8192
QUICK_CONCURRENCY, QUICK_REQUESTS = (1, 4), (2, 4)
# --items headline: one request in flight (each request alone) and the most (throughput); quick: both levels
HEADLINE_CONCURRENCY = (1, 32)
QUICK_PROMPT_LENS, QUICK_MAX_TOKENS, QUICK_MAX_BATCHED_TOKENS = (6, 10), 3, 256
PROMPT_SEED, WARMUP_SEED = 3, 4


def check_indices(requests: int, quick: bool) -> list[int]:
    """Requests compared with themselves alone: the first two (quick: those concurrency 1 already ran
    alone, so no extra run), first, middle and last (full)."""
    return list(range(min(2, requests))) if quick else sorted({0, requests // 2, requests - 1})


def random_prompts(count: int, lengths: tuple[int, int], vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(lengths[0], lengths[1] + 1, (count,), generator=g).tolist()
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in sizes]


def kv_cache_bytes(config, device: torch.device, dtype: torch.dtype, concurrency: int, tokens: int) -> int:
    """Twice the pages ``concurrency`` sequences of ``tokens`` tokens need (no preemption, small
    allocation; the engine's default would take half the free GPU memory)."""
    page_size = ModelRunner.page_size_for(config, device, dtype)
    layout = kv_cache_layout(config)  # a page holds one KV cache group's layers: a sequence needs pages in each
    pages = concurrency * -(-tokens // page_size) * len(layout.groups) + 1
    return 2 * pages * layout.page_bytes(dtype, page_size)


class _Stamps(BaseStreamer):
    """Time of every ``put`` of generated tokens (the first ``put`` is the prompt)."""

    def __init__(self):
        self.prompt_seen, self.times = False, []

    def put(self, value):  # generate passes CPU tensors: the step's GPU work is done
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self):
        pass


def _summary(stamps: list[tuple[float, float, float, int]], start: float, end: float) -> dict:
    """stamps: (submitted, first token, finish, tokens) per request."""
    tokens = sum(s[3] for s in stamps)
    tpot = [(finish - first) / (n - 1) for _, first, finish, n in stamps if n > 1]
    return {"requests": len(stamps), "output_tokens": tokens, "elapsed_s": end - start,
            "tokens_per_s": tokens / max(end - start, 1e-9),
            "tpot_ms": 1e3 * sum(tpot) / len(tpot) if tpot else None,
            "ttft_ms": 1e3 * sum(first - sub for sub, first, _, _ in stamps) / len(stamps)}


def run_engine(engine: Engine, prompts, params: SamplingParams, concurrency: int, device: torch.device):
    """Closed loop: ``concurrency`` requests in flight until all ``prompts`` finish.
    Returns (outputs in prompt order, summary dict)."""
    pending = list(range(len(prompts)))[::-1]
    in_flight: dict[str, int] = {}
    submitted, first, outputs, stamps = {}, {}, {}, []
    _sync(device)
    start = time.perf_counter()
    while pending or in_flight:
        while pending and len(in_flight) < concurrency:
            i = pending.pop()
            in_flight[engine.add_request(prompts[i], params)] = i
            submitted[i] = time.perf_counter()
        step_outputs = engine.step()
        _sync(device)
        now = time.perf_counter()
        for out in step_outputs:
            i = in_flight.get(out.request_id)
            if i is None:
                continue
            if out.token_ids and i not in first:
                first[i] = now
            if out.finished:
                if out.error:
                    raise RuntimeError(f"request {i} failed: {out.error}")
                del in_flight[out.request_id]
                outputs[i] = out
                stamps.append((submitted[i], first.get(i, now), now, len(out.token_ids)))
    return [outputs[i] for i in range(len(prompts))], _summary(stamps, start, time.perf_counter())


def run_generate(model, prompts, max_tokens: int, concurrency: int, device: torch.device) -> dict:
    """Stock ``model.generate``, greedy, on left-padded batches of ``concurrency`` prompts in turn."""
    stamps = []
    _sync(device)
    start = time.perf_counter()
    for b in range(0, len(prompts), concurrency):
        batch = prompts[b:b + concurrency]
        ids, mask = left_pad(batch, device=device)
        streamer = _Stamps()
        _sync(device)
        submitted = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens,
                                 min_new_tokens=max_tokens, do_sample=False, pad_token_id=0, streamer=streamer)
        _sync(device)
        finish = time.perf_counter()
        new = out.shape[1] - ids.shape[1]
        first = streamer.times[0] if streamer.times else finish
        stamps += [(submitted, first, finish, new)] * len(batch)
    return _summary(stamps, start, time.perf_counter())


def _engine(model, kernels: str, concurrency: int, kv_bytes: int, batched_tokens: int,
            cuda_graphs: bool | None = None) -> Engine:
    return Engine(model, max_num_seqs=concurrency, max_num_batched_tokens=batched_tokens,
                  kv_cache_memory=kv_bytes, kernels=kernels, cuda_graphs=cuda_graphs)


def run(ctx: Run, config=None, concurrency=None, requests=None, prompt_lens=None, max_tokens=None,
        dtype=torch.bfloat16, family: str = DEFAULT_FAMILY, preset: str = DEFAULT_PRESET) -> dict:
    config, name = preset_config(family, "tiny" if ctx.quick else preset, config)
    if concurrency is None:
        levels = ctx.grid(list(zip(CONCURRENCY, REQUESTS)), list(zip(QUICK_CONCURRENCY, QUICK_REQUESTS)),
                          [(c, n) for c, n in zip(CONCURRENCY, REQUESTS) if c in HEADLINE_CONCURRENCY],
                          list(zip(QUICK_CONCURRENCY, QUICK_REQUESTS)))
        concurrency = tuple(c for c, _ in levels)
        requests = requests or tuple(n for _, n in levels)
    requests = requests or (QUICK_REQUESTS if ctx.quick else REQUESTS)
    if not concurrency:
        return {"engine": []}
    prompt_lens = prompt_lens or (QUICK_PROMPT_LENS if ctx.quick else PROMPT_LENS)
    max_tokens = max_tokens or (QUICK_MAX_TOKENS if ctx.quick else MAX_TOKENS)
    batched_tokens = QUICK_MAX_BATCHED_TOKENS if ctx.quick else MAX_BATCHED_TOKENS
    model = build_model(ctx, config, dtype)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    pool = random_prompts(max(requests), prompt_lens, config.vocab_size, PROMPT_SEED)
    alone: dict[int, object] = {}  # prompt index -> output of the request alone (invariant engine)
    model_info = {"preset": name, "layers": config.num_hidden_layers, "hidden": config.hidden_size,
                  "vocab": config.vocab_size, "dtype": str(dtype)[6:],
                  "params_m": sum(p.numel() for p in model.parameters()) / 1e6}
    rows = []
    for conc, count in zip(concurrency, requests):
        prompts = pool[:count]
        warmup = random_prompts(conc, prompt_lens, config.vocab_size, WARMUP_SEED + conc)
        kv_bytes = kv_cache_bytes(config, ctx.device, dtype, conc, prompt_lens[1] + max_tokens)
        shared = {"concurrency": conc, "prompt_tokens": sum(map(len, prompts)), "min_prompt": prompt_lens[0],
                  "max_prompt": prompt_lens[1], "max_tokens": max_tokens}
        by_mode = {}
        for mode in MODES:  # the invariant engine first: the budget may end before the others
            item = f"engine {mode} c={conc}"
            if mode == "invariant_engine_eager" and not ctx.on_gpu:
                continue
            if ctx.out_of_time(item):
                continue
            row = {"mode": mode, **shared, "max_num_batched_tokens": None, "preemptions": None,
                   "invariant_rows_checked": None, "invariant_rows_equal": None}
            try:
                if mode == "hf_generate":
                    model.set_attn_implementation("sdpa")
                    if ctx.on_gpu:  # warm-up: one batch, 2 tokens
                        run_generate(model, warmup, 2, conc, ctx.device)
                    row.update(run_generate(model, prompts, max_tokens, conc, ctx.device))
                else:
                    kernels = "stock" if mode == "stock_engine" else "invariant"
                    graphs = False if mode == "invariant_engine_eager" else None
                    try:
                        if ctx.on_gpu:  # warm-up in its own engine (no prefix-cache hits later): compiles kernels
                            run_engine(_engine(model, kernels, conc, kv_bytes, batched_tokens, graphs), warmup,
                                       SamplingParams(max_tokens=2, ignore_eos=True), conc, ctx.device)
                        engine = _engine(model, kernels, conc, kv_bytes, batched_tokens, graphs)
                        outputs, summary = run_engine(engine, prompts, params, conc, ctx.device)
                        row.update(summary, max_num_batched_tokens=batched_tokens,
                                   preemptions=engine.core.scheduler.num_preemptions)
                        if mode == "invariant_engine" and conc == 1:  # one in flight: each request ran alone
                            for i, out in enumerate(outputs):
                                alone.setdefault(i, out)
                        elif mode == "invariant_engine":
                            checked = check_indices(count, ctx.quick)
                            for i in checked:
                                if i not in alone:
                                    alone[i] = run_engine(_engine(model, "invariant", 1, kv_bytes, batched_tokens),
                                                          [prompts[i]], params, 1, ctx.device)[0][0]
                            row["invariant_rows_checked"] = len(checked)
                            row["invariant_rows_equal"] = sum(
                                outputs[i].token_ids == alone[i].token_ids and outputs[i].logprobs == alone[i].logprobs
                                for i in checked)
                        del engine
                    finally:
                        restore(model)
                        model.set_attn_implementation("sdpa")
                        free_memory(ctx.device)
            except Exception as exc:
                ctx.failed(item, exc)
                continue
            row.update(model_info)
            by_mode[mode] = row
        inv = by_mode.get("invariant_engine")
        for mode in MODES:
            row = by_mode.get(mode)
            if row is None:
                continue
            for key, other in (("invariant_to_stock_engine", "stock_engine"),
                               ("invariant_to_hf_generate", "hf_generate"), ("graphs_to_eager", "invariant_engine_eager")):
                ref = by_mode.get(other)
                row[key] = (inv["tokens_per_s"] / ref["tokens_per_s"]
                            if mode == "invariant_engine" and ref and ref["tokens_per_s"] else None)
            rows.append(row)
    del model
    free_memory(ctx.device)
    return {"engine": rows}
