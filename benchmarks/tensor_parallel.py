"""Tensor parallelism's cost: the bytes the row-parallel exchange moves, on paper, and the engine's
step time at TP 1 and TP 2 (4, 8 where the machine has the GPUs), side by side in one run.

On paper (``tp_exchange``, the preset's real widths, also in quick mode): o_proj and down_proj split K across the
ranks. Stock tensor parallelism all-reduces each layer's output in the model dtype: a ring
all-reduce sends (and receives) 2 (t - 1) / t x N x 2 bytes per token in bf16. The invariant
exchange all-gathers every rank's fp32 leaf sums of the layer's K tree (L leaves, L / t per
rank): a ring all-gather sends (t - 1) / t x L x N x 4 bytes per token, L times the bf16
all-reduce's bytes. The embedding (one byte-wise all-reduce of [tokens x hidden]) and the lm_head
(an all-gather of vocabulary slices) move what stock TP moves for them, and are not counted.

Measured (``tp_steps``): one engine over the same random checkpoint at each size, the same
requests (greedy, one prefill step, then decode steps), each step timed on rank 0's clock; the
ratio to TP 1 and whether every output (tokens and logprobs) is bitwise TP 1's. On CPU the ranks
share the cores and the kernels run in the Triton interpreter: the ratio says what the
coordination costs there, not what a GPU would gain.
"""
from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch

from invariant_infer.engine import Engine, SamplingParams
from invariant_infer.kernels.configs import tree_leaves
from invariant_infer.checkpoints.loading import load_model
from invariant_infer.testing.random_checkpoints import random_config, save_random_checkpoint
from invariant_infer.model.tensor_parallel import supported_tp_sizes
from invariant_infer.parallel import TensorParallelRanks

from .timing import Run, free_memory

SIZES = (2, 4, 8)
# Quick (CPU): 8 query / 4 KV heads of 16, intermediate 256, so TP 2 and 4 divide.
QUICK_SHAPE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=8, num_key_value_heads=4, head_dim=16,
                   num_hidden_layers=2)
MEASURED_LAYERS = 4  # full suite: the preset's widths, this many decoder layers
REQUESTS, PROMPT, DECODE = 8, 64, 16
QUICK_REQUESTS, QUICK_PROMPT, QUICK_DECODE = 4, 12, 4


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def exchange_rows(config, preset: str) -> list[dict]:
    """Bytes per token per layer, ours and stock bf16, for each TP size the model supports."""
    rows = []
    layers = {"o_proj": config.num_attention_heads * _head_dim(config), "down_proj": config.intermediate_size}
    for size in [t for t in SIZES if t in supported_tp_sizes(config)]:
        for name, k in layers.items():
            n, leaves = config.hidden_size, tree_leaves(k)
            ours = (size - 1) / size * leaves * n * 4
            stock = 2 * (size - 1) / size * n * 2
            rows.append({"preset": preset, "tp": size, "layer": name, "N": n, "K": k, "leaves": leaves,
                         "ours_bytes_per_token": ours, "stock_bf16_bytes_per_token": stock, "ratio": ours / stock,
                         "ours_bytes_per_token_model": ours * config.num_hidden_layers,
                         "stock_bytes_per_token_model": stock * config.num_hidden_layers})
    return rows


def _timed_steps(engine: Engine, prompts: list[list[int]], decode: int, device) -> tuple[list[float], list]:
    params = SamplingParams(max_tokens=decode, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    times, finished = [], {}
    while engine.has_unfinished():
        start = time.perf_counter()
        outputs = engine.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
        finished.update({o.request_id: (o.token_ids, o.logprobs) for o in outputs if o.finished})
    return times, [finished[i] for i in ids]


def _measure(engine: Engine, prompts, decode, device, size: int, baseline: dict | None) -> dict:
    _timed_steps(engine, prompts[:1], 2, device)  # warm-up: compiles the kernels on a GPU
    engine.reset_prefix_cache()
    times, outputs = _timed_steps(engine, prompts, decode, device)
    prefill, decode_steps = times[0], times[1:]
    row = {"tp": size, "requests": len(prompts), "prompt_tokens": len(prompts[0]), "decode_tokens": decode,
           "steps": len(times), "prefill_step_ms": prefill,
           "decode_step_ms": statistics.median(decode_steps) if decode_steps else None, "outputs": outputs}
    if baseline is not None:
        row["prefill_ratio_to_tp1"] = prefill / baseline["prefill_step_ms"]
        row["decode_ratio_to_tp1"] = (row["decode_step_ms"] / baseline["decode_step_ms"]
                                      if row["decode_step_ms"] and baseline["decode_step_ms"] else None)
        row["bitwise_equal_to_tp1"] = outputs == baseline["outputs"]
    else:
        row.update(prefill_ratio_to_tp1=1.0, decode_ratio_to_tp1=1.0, bitwise_equal_to_tp1=True)
    return row


def run(ctx: Run, family: str = "qwen2", preset: str = "qwen2.5-1.5b", rank_init=None, **_) -> dict:
    """The ``tensor_parallel`` section (``rank_init``: given to ``TensorParallelRanks``, for controls)."""
    exchange = exchange_rows(random_config(family, preset), f"{family}:{preset}")  # arithmetic: real widths
    device = ctx.device
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    config = (random_config(family, "tiny", **QUICK_SHAPE) if ctx.quick
              else random_config(family, preset, num_hidden_layers=MEASURED_LAYERS))
    n, prompt_len, decode = ((QUICK_REQUESTS, QUICK_PROMPT, QUICK_DECODE) if ctx.quick
                             else (REQUESTS, PROMPT, DECODE))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, config.vocab_size, (prompt_len,), generator=gen).tolist() for _ in range(n)]
    sizes = [1] + [t for t in SIZES if t in supported_tp_sizes(config) and (t <= 2 if device.type == "cpu"
                                                                              else t <= gpus)]
    dtype = "fp32" if device.type == "cpu" else "bf16"
    steps = []
    if device.type == "cuda" and gpus < 2:  # TP 1 alone measures nothing about tensor parallelism
        ctx.skipped.append({"section": ctx.section, "item": "tensor_parallel steps",
                            "reason": f"needs two or more GPUs (found {gpus})"})
        return {"tp_exchange": exchange, "tp_steps": steps}
    with tempfile.TemporaryDirectory(prefix="bench-tp-") as folder:
        path = str(save_random_checkpoint(Path(folder) / "model", config, seed=0))
        baseline = None
        for size in sizes:
            if ctx.out_of_time(f"tensor_parallel TP {size}"):
                continue
            if size > 1 and baseline is None:  # nothing to compare with
                ctx.skipped.append({"section": ctx.section, "item": f"tensor_parallel TP {size}",
                                    "reason": "TP 1 did not run"})
                continue
            try:
                if size == 1:
                    model = load_model(path, dtype=dtype, device=device.type)
                    row = _measure(Engine(model), prompts, decode, device, 1, None)
                    del model
                    baseline = row
                else:
                    with TensorParallelRanks(path, size, dtype=dtype, device=device.type,
                                             rank_init=rank_init) as ranks:
                        row = _measure(Engine(ranks.model, executor=ranks), prompts, decode, device, size, baseline)
            except Exception as exc:  # keep the other sizes' numbers
                ctx.failed(f"tensor_parallel TP {size}", exc)
                continue
            free_memory(device)
            steps.append(row)
    for row in steps:
        row.pop("outputs")
        row.update(dtype=dtype, hidden=config.hidden_size, layers=config.num_hidden_layers)
    skipped = [t for t in SIZES if t in supported_tp_sizes(config) and t not in sizes]
    if skipped and device.type == "cuda":  # on CPU, TP 2 only by design
        ctx.skipped.append({"section": ctx.section, "item": f"tensor_parallel TP {skipped}",
                            "reason": f"needs one GPU per rank (found {gpus})"})
    return {"tp_exchange": exchange, "tp_steps": steps}
