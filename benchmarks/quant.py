"""Quantized GEMMs: the invariant quantized GEMM (``kernels.quantized_linear``) vs the stock paths
on the same compressed weights, with the weight bytes against bf16, and whether a row alone equals
that row inside the batch.

Weights: N(0, 1 / K) in bf16, quantized and compressed by compressed-tensors' own compressors
(presets ``FP8_BLOCK``: fp8 128x128 blocks; ``FP8_DYNAMIC``: fp8 per channel; ``W4A16``: int4
pack-quantized, one scale per 128 along K). Inputs N(0, 1), bf16. Per (shape, format, M):
  * ``invariant``: as a patched layer runs it: ``quantize_activations`` (per token, per 128-group for
    blocks) then ``quantized_linear``; int4 is weight-only.
  * stock fp8: per-token activations quantized in torch, then ``torch._scaled_mm`` (row-wise scales;
    block scales where this torch and GPU take them) on CUDA, else compressed-tensors' decompression
    to bf16 and ``F.linear``; stock int4: compressed-tensors' decompression and ``F.linear``. ``stock``
    names the path that ran.
  * ``bf16``: ``F.linear`` on the dense bf16 weight, for scale.
Shapes: the ``--model-preset``'s projections (default Qwen2.5-1.5B) and Qwen3-30B-A3B's experts
(hidden 2048, moe_intermediate 768); quick: two tiny shapes at M = 1, 8, no timings (the CPU runs
the kernels in the Triton interpreter), bits and bytes only.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from tqdm import tqdm

from invariant_infer.kernels import QuantizedWeight, quantize_activations, quantized_linear

from .matmul import DEFAULT_FAMILY, DEFAULT_PRESET, model_shapes
from .timing import Run, free_memory, time_ms

FORMATS = {"fp8_block": "FP8_BLOCK", "fp8_channel": "FP8_DYNAMIC", "int4_w4a16": "W4A16"}
MS, QUICK_MS = (1, 64, 2048), (1, 8)
EXPERT_SHAPES = {"expert gate/up": (768, 2048), "expert down": (2048, 768)}  # Qwen3-30B-A3B, per expert
QUICK_SHAPES = {"tiny": {"gate/up": (256, 128), "down": (128, 256)}}
DENSE_PROJECTIONS = ("q", "k/v", "o", "gate/up", "down")  # lm_head stays unquantized in the presets


def compressed_weight(w: torch.Tensor, scheme_name: str):
    """``w`` [N, K] quantized with compressed-tensors' preset ``scheme_name`` and compressed by its
    compressor: (the compressed state dict, the scheme, the compressor class)."""
    from compressed_tensors.compressors import FloatQuantizationCompressor, PackedQuantizationCompressor

    from invariant_infer.testing.quantized_checkpoints import quantize_model

    layer = torch.nn.Sequential(torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=w.dtype, device=w.device))
    with torch.no_grad():
        layer[0].weight.copy_(w)
    linear = quantize_model(layer, scheme_name)[0]
    scheme = linear.quantization_scheme
    compressor = PackedQuantizationCompressor if scheme_name == "W4A16" else FloatQuantizationCompressor
    state = {name: getattr(linear, name) for name in ("weight", "weight_scale", "weight_zero_point")
             if getattr(linear, name, None) is not None}
    with torch.no_grad():
        return compressor.compress(state, scheme), scheme, compressor


def invariant_weight(compressed: dict, fmt: str, shape) -> QuantizedWeight:
    if fmt == "int4_w4a16":
        return QuantizedWeight("packed", compressed["weight_packed"], compressed["weight_scale"], shape, bits=4,
                               group_size=128)
    scale = compressed["weight_scale"]
    return QuantizedWeight("fp8", compressed["weight"], scale if fmt == "fp8_block" else scale.reshape(-1, 1), shape,
                           block=fmt == "fp8_block")


def stored_bytes(weight: QuantizedWeight) -> int:
    tensors = [weight.data, weight.scale] + ([weight.zero_point] if weight.zero_point is not None else [])
    return sum(t.numel() * t.element_size() for t in tensors)


def invariant_fn(weight: QuantizedWeight, fmt: str):
    if fmt == "int4_w4a16":
        return lambda x: quantized_linear(x, weight)
    group = 128 if fmt == "fp8_block" else None

    def run(x):
        q, scale = quantize_activations(x, torch.float8_e4m3fn, group)
        return quantized_linear(q, weight, x_scale=scale, out_dtype=x.dtype)
    return run


def _per_token_fp8(x: torch.Tensor, group: int | None):
    xg = x.float().unflatten(1, (-1, group)) if group else x.float()[:, None]
    scale = (xg.abs().amax(dim=-1, keepdim=True) / 448.0).clamp(min=1e-12)
    q = (xg / scale).clamp(-448, 448).to(torch.float8_e4m3fn).flatten(1)
    return q, scale.squeeze(-1)


DECOMPRESS = "compressed-tensors decompress + F.linear"


def stock_fns(compressed: dict, scheme, compressor, weight: QuantizedWeight, fmt: str, device) -> dict:
    """{name: x -> y} of the stock paths this device runs, the preferred first (see the module
    docstring); compressed-tensors' decompression + ``F.linear`` is always there, last."""
    def decompress_matmul(x):
        return F.linear(x, compressor.decompress(compressed, scheme)["weight"].to(x.dtype))

    fallback = {DECOMPRESS: decompress_matmul}
    if fmt == "int4_w4a16" or device.type != "cuda":
        return fallback
    w_t = weight.data.t()  # column-major, as _scaled_mm takes its second operand
    if fmt == "fp8_channel":
        w_scale = weight.scale.float().reshape(1, -1)

        def scaled_mm(x):
            q, s = _per_token_fp8(x, None)
            return torch._scaled_mm(q, w_t, scale_a=s.reshape(-1, 1), scale_b=w_scale, out_dtype=x.dtype)
    else:
        w_scale = weight.scale.float().t().contiguous().t()  # [N/128, K/128], K-major as blockwise takes it

        def scaled_mm(x):
            q, s = _per_token_fp8(x, 128)
            return torch._scaled_mm(q, w_t, scale_a=s.t().contiguous().t(), scale_b=w_scale.t(), out_dtype=x.dtype)
    try:  # a scale layout this torch takes but reads otherwise would show as a large difference
        with torch.no_grad():
            probe = torch.randn(16, weight.shape[1], device=device, dtype=torch.bfloat16)
            got, want = scaled_mm(probe).float(), decompress_matmul(probe).float()
        if (got - want).abs().max() > 0.1 * want.abs().max():
            return fallback
        return {"torch._scaled_mm": scaled_mm, **fallback}
    except (RuntimeError, TypeError, NotImplementedError):  # this torch or GPU: no such scaling
        return fallback


def _first_that_runs(stocks: dict, x: torch.Tensor):
    """(name, fn, fn(x)) of the first stock path that runs at this M (e.g. _scaled_mm's size limits)."""
    for name, fn in list(stocks.items())[:-1]:
        try:
            return name, fn, fn(x)
        except (RuntimeError, TypeError, NotImplementedError):
            continue
    name, fn = list(stocks.items())[-1]
    return name, fn, fn(x)


def _alone_equal(fn, x: torch.Tensor, y: torch.Tensor) -> bool:
    rows = sorted({0, x.shape[0] // 2, x.shape[0] - 1})
    return all(torch.equal(fn(x[r:r + 1])[0], y[r]) for r in rows)


def shape_sets(ctx: Run, family: str, preset: str) -> dict:
    if ctx.quick:
        return QUICK_SHAPES
    dense = model_shapes(family, preset)
    return {f"{family}:{preset}": {name: dense[name][:2] for name in DENSE_PROJECTIONS},
            "qwen3_moe:qwen3-30b-a3b": EXPERT_SHAPES}


def _time(ctx: Run, fn) -> float | None:
    if not ctx.on_gpu:
        return None  # the interpreter's times say nothing about a GPU's
    return time_ms(fn, ctx.device, reps=10, warmup=1, flush_l2=True)


def run(ctx: Run, ms=None, family: str = DEFAULT_FAMILY, preset: str = DEFAULT_PRESET, **_) -> dict:
    """The ``quant`` section: one row per (model, shape, format, M)."""
    ms = tuple(ms or (QUICK_MS if ctx.quick else MS))
    gen = torch.Generator().manual_seed(0)
    items = [(model, name, n, k, fmt) for model, shapes in shape_sets(ctx, family, preset).items()
             for name, (n, k) in shapes.items() for fmt in FORMATS]
    rows = []
    for model, name, n, k, fmt in tqdm(items, desc="quant", leave=False):
        if ctx.out_of_time(f"quant {model} {name} {fmt}"):
            continue
        try:
            w = (torch.randn(n, k, generator=gen) * k ** -0.5).to(ctx.device, torch.bfloat16)
            x_all = torch.randn(max(ms), k, generator=gen).to(ctx.device, torch.bfloat16)
            compressed, scheme, compressor = compressed_weight(w, FORMATS[fmt])
            weight = invariant_weight(compressed, fmt, (n, k))
            inv = invariant_fn(weight, fmt)
            stocks = stock_fns(compressed, scheme, compressor, weight, fmt, ctx.device)
            for m in ms:
                x = x_all[:m]
                with torch.no_grad():
                    y_inv, y_bf16 = inv(x), F.linear(x, w)
                    stock_name, stock, y_stock = _first_that_runs(stocks, x)
                    row = {"model": model, "shape": name, "format": fmt, "scheme": FORMATS[fmt], "M": m, "N": n,
                           "K": k, "stock": stock_name, "invariant_ms": _time(ctx, lambda: inv(x)),
                           "stock_ms": _time(ctx, lambda: stock(x)), "bf16_ms": _time(ctx, lambda: F.linear(x, w)),
                           "weight_bytes": stored_bytes(weight), "bf16_weight_bytes": n * k * 2,
                           "invariant_max_abs_diff_to_stock": (y_inv.float() - y_stock.float()).abs().max().item(),
                           "invariant_max_abs_diff_to_bf16": (y_inv.float() - y_bf16.float()).abs().max().item(),
                           "invariant_alone_bitwise_equal": _alone_equal(inv, x, y_inv),
                           "stock_alone_bitwise_equal": _alone_equal(stock, x, y_stock)}
                row["bytes_ratio"] = row["weight_bytes"] / row["bf16_weight_bytes"]
                timed = row["invariant_ms"] is not None and row["stock_ms"]
                row["ratio"] = row["invariant_ms"] / row["stock_ms"] if timed else None
                row["ratio_to_bf16"] = row["invariant_ms"] / row["bf16_ms"] if timed else None
                rows.append(row)
            del w, x_all, compressed, weight
        except Exception as exc:  # one failing shape must not end a one-shot GPU run
            ctx.failed(f"quant {model} {name} {fmt}", exc)
    free_memory(ctx.device)
    return {"quant": rows}
