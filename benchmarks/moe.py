"""One mixture-of-experts layer (router + experts + combine): tokens/s of the invariant layer vs
transformers' stock experts implementations on the same weights, and whether a token's output alone
equals its output inside the batch.

The layer is transformers' own ``Qwen3MoeSparseMoeBlock`` built from a one-layer ``Qwen3MoeConfig``
at Qwen3-30B-A3B widths (``LAYER``: hidden 2048, 128 experts, top-8, expert intermediate 768,
``norm_topk_prob``; quick: ``QUICK_LAYER``), weights drawn N(0, 1 / fan-in), bf16, inputs N(0, 1).
  * stock ``eager`` / ``batched_mm`` / ``grouped_mm``: ``config._experts_implementation`` set to the
    name (transformers' ``ExpertsInterface``), the stock router (``F.linear``, fp32 softmax,
    ``torch.topk``); an implementation that fails on the device is recorded with the reason, and
    ``batched_mm`` (it gathers both expert weights per (token, slot) pair: 100+ GB at 2048 tokens) is
    not run where that would take over 60% of the free GPU memory.
  * ``invariant``: the same block as ``make_invariant`` patches it (``invariant_infer.model.experts``):
    the router on the invariant linear and ``moe_routing``, the experts through the ``invariant``
    ExpertsInterface entry (``grouped_linear`` / ``grouped_silu_mul_linear``, one launch each for all
    experts), the top-k outputs summed in rank order in fp32.
  * ``invariant_fp8``: the same, with the experts' weights quantized to fp8 in 128x128 blocks (as
    transformers' ``fp8`` checkpoints store them) and run as ``make_invariant`` runs ``FP8Experts``
    (``invariant_infer.model.quantized_experts``: activations per token and 128-group,
    ``grouped_quantized_linear``); its time ratio is to ``invariant``'s (bf16 experts). Needs widths
    that are multiples of 128 (skipped in the quick layer).
Per token count T: one forward over T tokens, timed; then tokens 0, T // 2 and T - 1 each alone (a
1-token forward) against their rows of the T-token output: bitwise (``torch.equal``) and max |Δ|.
"""
from __future__ import annotations

import types

import torch
from tqdm import tqdm
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from invariant_infer.kernels import QuantizedWeight
from invariant_infer.model import experts as hf_experts
from invariant_infer.model.families import FAMILIES
from invariant_infer.model.module_state import module_state
from invariant_infer.model.quantized_experts import QuantizedExpertsPlan, quantized_experts_forward

from .timing import Run, free_memory, time_ms

LAYER = dict(hidden_size=2048, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768)
QUICK_LAYER = dict(hidden_size=64, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
TOKENS, QUICK_TOKENS = (1, 64, 2048), (1, 4, 16)
STOCK = ("eager", "batched_mm", "grouped_mm")
IMPLEMENTATIONS = ("invariant", "invariant_fp8") + STOCK  # invariant first: every other row's ratio needs its time


def build_layer(layer: dict, device, dtype=torch.bfloat16, seed: int = 0) -> Qwen3MoeSparseMoeBlock:
    config = Qwen3MoeConfig(num_hidden_layers=1, norm_topk_prob=True, **layer)
    config._experts_implementation = "eager"
    block = Qwen3MoeSparseMoeBlock(config)  # parameters allocated, not initialised
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in block.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * param.shape[-1] ** -0.5)
    return block.to(device=device, dtype=dtype).eval().requires_grad_(False)


def layer_fn(block: Qwen3MoeSparseMoeBlock, implementation: str):
    """x [T, H] -> [T, H] through one implementation (it stays selected until the next call).
    ``invariant`` is what ``make_invariant`` installs in a Qwen3-MoE model: the family's router
    forward on ``block.gate`` and the ``invariant`` entry of transformers' ``ExpertsInterface``."""
    block.experts.__dict__.pop("forward", None)
    if implementation.startswith("invariant"):
        hf_experts.register()
        block.gate.forward = types.MethodType(hf_experts.router_forward(FAMILIES["qwen3_moe"].moe), block.gate)
    else:
        block.gate.__dict__.pop("forward", None)  # the class's stock router
    block.experts.config._experts_implementation = "invariant" if implementation == "invariant_fp8" else implementation
    if implementation == "invariant_fp8":
        experts = block.experts
        module_state(experts).quantized = QuantizedExpertsPlan(fp8_blocks(experts.gate_up_proj),
                                                               fp8_blocks(experts.down_proj))
        experts.forward = types.MethodType(quantized_experts_forward, experts)
    return lambda x: block(x[None])[0]


def fp8_blocks(weight: torch.Tensor) -> QuantizedWeight:
    """Stacked expert weights [E, N, K] as fp8 with one inverse scale per 128x128 block (max |w| / 448)."""
    e, n, k = weight.shape
    if n % 128 or k % 128:
        raise ValueError(f"fp8 blocks need expert widths that are multiples of 128, got {n}x{k}")
    blocks = weight.float().view(e, n // 128, 128, k // 128, 128)
    scale = (blocks.abs().amax(dim=(2, 4)) / 448.0).clamp(min=1e-12)
    q = (blocks / scale[:, :, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(e, n, k)
    return QuantizedWeight("fp8", q, scale, (n, k), block=True)


def gathered_weights_gb(block: Qwen3MoeSparseMoeBlock, tokens: int) -> float:
    """What ``batched_mm`` allocates: both expert weights gathered once per (token, slot) pair."""
    experts = block.experts
    per_pair = experts.gate_up_proj[0].numel() + experts.down_proj[0].numel()
    return tokens * block.gate.top_k * per_pair * experts.down_proj.element_size() / 1e9


def too_big(block: Qwen3MoeSparseMoeBlock, implementation: str, tokens: int, device) -> str | None:
    """Why an implementation is not run at this token count (None: run it)."""
    experts = block.experts
    if implementation == "invariant_fp8" and (experts.hidden_dim % 128 or experts.intermediate_dim % 128):
        return "skipped: fp8 128x128 blocks need a hidden and expert intermediate size that are multiples of 128"
    if implementation != "batched_mm" or device.type != "cuda":
        return None
    need, free = gathered_weights_gb(block, tokens), torch.cuda.mem_get_info(device)[0] / 1e9
    return f"skipped: would need {need:.3g} GB (free {free:.3g} GB)" if need > 0.6 * free else None


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
    hf_experts.check_sparse_block(FAMILIES["qwen3_moe"], block, "the moe layer")  # as make_invariant does
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
                row["skipped"] = too_big(block, implementation, count, ctx.device)
                if row["skipped"]:
                    continue
                try:
                    measured = _measure(ctx, layer_fn(block, implementation), x, eager_out)
                    row.update(measured)
                    times[implementation] = measured["ms"]
                except Exception as exc:  # e.g. a stock implementation the device cannot run
                    ctx.failed(f"moe {implementation} T={count}", exc)
                    row["skipped"] = f"{type(exc).__name__}: {exc}"[:300]
            for row in batch_rows:  # invariant time / this implementation's time (above 1 = invariant slower)
                impl = row["implementation"]
                if impl == "invariant_fp8":  # fp8 experts' time / bf16 experts' (both invariant)
                    mine, theirs = times.get(impl), times.get("invariant")
                else:
                    mine, theirs = times.get("invariant"), times.get(impl) if impl != "invariant" else None
                row["invariant_time_ratio"] = mine / theirs if mine and theirs else None
            rows += batch_rows
    finally:
        del block
        free_memory(ctx.device)
    for row in rows:
        for key in ("ms", "tokens_per_s", "alone_checked", "alone_bitwise_equal", "alone_max_abs_diff",
                    "max_abs_diff_to_eager", "invariant_time_ratio"):
            row.setdefault(key, None)
    return {"moe": rows}
