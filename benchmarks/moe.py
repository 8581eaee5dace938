"""One mixture-of-experts layer (router + experts + combine): tokens/s of the invariant layer vs
transformers' stock experts implementations on the same weights, and whether a token's output alone
equals its output inside the batch.

The layer is transformers' own ``Qwen3MoeSparseMoeBlock`` built from a one-layer ``Qwen3MoeConfig``
at Qwen3-30B-A3B widths (``LAYER``: hidden 2048, 128 experts, top-8, expert intermediate 768,
``norm_topk_prob``; quick: ``QUICK_LAYER``), weights drawn N(0, 1 / fan-in), bf16, inputs N(0, 1).
  * stock ``eager`` / ``batched_mm`` / ``grouped_mm``: ``config._experts_implementation`` set to the
    name (transformers' ``ExpertsInterface``), the stock router (``F.linear``, fp32 softmax,
    ``torch.topk``); an implementation that fails on the device is recorded with the reason.
  * ``invariant``: ``invariant_moe`` (the router on the invariant linear, row-wise routing, each
    token's experts on the invariant kernels, the top-k outputs summed in rank order in fp32).
Per token count T: one forward over T tokens, timed; then tokens 0, T // 2 and T - 1 each alone (a
1-token forward) against their rows of the T-token output: bitwise (``torch.equal``) and max |Δ|.
"""
from __future__ import annotations

import torch
from tqdm import tqdm
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from invariant_infer.kernels import linear
from invariant_infer.kernels.fused_linear import silu_mul_linear

from .timing import Run, free_memory, time_ms

LAYER = dict(hidden_size=2048, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768)
QUICK_LAYER = dict(hidden_size=64, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
TOKENS, QUICK_TOKENS = (1, 64, 2048), (1, 4, 16)
STOCK = ("eager", "batched_mm", "grouped_mm")
IMPLEMENTATIONS = ("invariant",) + STOCK  # invariant first: every stock row's ratio needs its time


def build_layer(layer: dict, device, dtype=torch.bfloat16, seed: int = 0) -> Qwen3MoeSparseMoeBlock:
    config = Qwen3MoeConfig(num_hidden_layers=1, norm_topk_prob=True, **layer)
    config._experts_implementation = "eager"
    block = Qwen3MoeSparseMoeBlock(config)  # parameters allocated, not initialised
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in block.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * param.shape[-1] ** -0.5)
    return block.to(device=device, dtype=dtype).eval().requires_grad_(False)


def route(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: fp32 softmax, the top-k by a stable descending sort (ties to the lowest expert),
    renormalised in rank order."""
    ranked = torch.sort(torch.softmax(logits.float(), dim=-1), dim=-1, descending=True, stable=True)
    weights, experts = ranked.values[:, :top_k], ranked.indices[:, :top_k]
    if normalize:
        total = weights[:, 0]
        for rank in range(1, top_k):
            total = total + weights[:, rank]
        weights = weights / total[:, None]
    return weights, experts


def invariant_moe(block: Qwen3MoeSparseMoeBlock, x: torch.Tensor) -> torch.Tensor:
    """[T, H] -> [T, H], each row on its own: the router on ``linear``, ``route``, every (token, slot)
    pair through its expert's gate/up and down projections on the invariant kernels, the top-k
    outputs weighted and summed in rank order in fp32, cast once."""
    gate, experts = block.gate, block.experts
    logits = linear(x, gate.weight)
    weights, chosen = route(logits, gate.top_k, gate.norm_topk_prob)
    weights = weights.to(logits.dtype)  # as the stock router hands them to the experts
    tokens, top_k = chosen.shape
    flat = chosen.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat, minlength=experts.num_experts).tolist()
    rows, inter = x[order // top_k], experts.down_proj.shape[2]
    out = torch.empty(rows.shape[0], x.shape[1], device=x.device, dtype=x.dtype)
    start = 0
    for expert, count in enumerate(counts):
        if count:
            gate_up = linear(rows[start:start + count], experts.gate_up_proj[expert])
            out[start:start + count] = silu_mul_linear(gate_up[:, :inter], gate_up[:, inter:],
                                                       experts.down_proj[expert])
        start += count
    pairs = torch.empty_like(out)
    pairs[order] = out
    pairs = pairs.view(tokens, top_k, -1).float()
    total = pairs[:, 0] * weights[:, 0, None].float()
    for rank in range(1, top_k):
        total = total + pairs[:, rank] * weights[:, rank, None].float()
    return total.to(x.dtype)


def layer_fn(block: Qwen3MoeSparseMoeBlock, implementation: str):
    """x [T, H] -> [T, H] through one implementation."""
    if implementation == "invariant":
        return lambda x: invariant_moe(block, x)

    def stock(x):
        block.experts.config._experts_implementation = implementation
        return block(x[None])[0]
    return stock


def _alone_tokens(tokens: int) -> list:
    return sorted({0, tokens // 2, tokens - 1})


def _measure(ctx: Run, fn, x: torch.Tensor, reference: torch.Tensor) -> dict:
    with torch.no_grad():
        y = fn(x)  # warm-up (compiles the Triton kernels on a GPU)
        ms = time_ms(lambda: fn(x), ctx.device, reps=10 if ctx.on_gpu else 3, warmup=1 if ctx.on_gpu else 0)
        checked = _alone_tokens(x.shape[0])
        alone = torch.cat([fn(x[t:t + 1]) for t in checked])
    batch = y[checked]
    return {"ms": ms, "tokens_per_s": x.shape[0] / (ms * 1e-3), "alone_checked": len(checked),
            "alone_bitwise_equal": torch.equal(alone, batch),
            "alone_max_abs_diff": (alone.float() - batch.float()).abs().max().item(),
            "max_abs_diff_to_eager": (y.float() - reference.float()).abs().max().item()}


def run(ctx: Run, layer: dict | None = None, tokens=None, dtype=torch.bfloat16, **_preset) -> dict:
    """The ``moe`` section (its layer is Qwen3-30B-A3B's whatever ``--model-preset`` says)."""
    layer = layer or (QUICK_LAYER if ctx.quick else LAYER)
    tokens = tuple(tokens or (QUICK_TOKENS if ctx.quick else TOKENS))
    block = build_layer(layer, ctx.device, dtype)
    info = {"hidden": layer["hidden_size"], "experts": layer["num_experts"], "top_k": layer["num_experts_per_tok"],
            "intermediate": layer["moe_intermediate_size"], "dtype": str(dtype).removeprefix("torch.")}
    gen = torch.Generator().manual_seed(1)
    inputs = torch.randn(max(tokens), layer["hidden_size"], generator=gen).to(ctx.device, dtype)
    rows = []
    try:
        # Token counts outer, implementations inner: a budget cut keeps whole token counts.
        for count in tqdm(tokens, desc="moe", leave=False):
            if ctx.out_of_time(f"moe T={count}"):
                continue
            x, times, batch_rows = inputs[:count], {}, []
            with torch.no_grad():
                eager_out = layer_fn(block, "eager")(x)
            for implementation in IMPLEMENTATIONS:
                row = {"tokens": count, "implementation": implementation, **info, "skipped": None}
                batch_rows.append(row)
                try:
                    measured = _measure(ctx, layer_fn(block, implementation), x, eager_out)
                    row.update(measured)
                    times[implementation] = measured["ms"]
                except Exception as exc:  # e.g. a stock implementation the device cannot run
                    ctx.failed(f"moe {implementation} T={count}", exc)
                    row["skipped"] = f"{type(exc).__name__}: {exc}"[:300]
            for row in batch_rows:  # invariant time / this implementation's time (above 1 = invariant slower)
                theirs = times.get(row["implementation"]) if row["implementation"] != "invariant" else None
                row["invariant_time_ratio"] = times["invariant"] / theirs if theirs and "invariant" in times else None
            rows += batch_rows
    finally:
        del block
        free_memory(ctx.device)
    for row in rows:
        for key in ("ms", "tokens_per_s", "alone_checked", "alone_bitwise_equal", "alone_max_abs_diff",
                    "max_abs_diff_to_eager", "invariant_time_ratio"):
            row.setdefault(key, None)
    return {"moe": rows}
