"""Quantized GEMMs: the invariant quantized GEMM (``kernels.quantized_linear``) vs the stock paths
on the same compressed weights, with the weight bytes against bf16, and whether a row alone equals
that row inside the batch.

Weights: N(0, 1 / K) in bf16, quantized and compressed by compressed-tensors' own compressors
(presets ``FP8_BLOCK``: fp8 128x128 blocks; ``FP8_DYNAMIC``: fp8 per channel; ``W4A16``: int4
pack-quantized, one scale per 128 along K); where compressed-tensors is not importable (the GPU
image), the fp8 formats are quantized in torch the same way (scale = max |w| / 448 per channel or
block) and the int4 rows are skipped. Inputs N(0, 1), bf16. Per (shape, format, M):
  * ``invariant``: as a patched layer runs it: ``quantize_activations`` (per token, per 128-group for
    blocks) then ``quantized_linear``; int4 is weight-only.
  * stock fp8: per-token activations quantized in torch, then ``torch._scaled_mm`` (row-wise scales;
    block scales where this torch and GPU take them) on CUDA, else compressed-tensors' decompression
    to bf16 and ``F.linear``; stock int4: compressed-tensors' decompression and ``F.linear``. ``stock``
    names the path that ran.
  * ``bf16``: ``F.linear`` on the dense bf16 weight, for scale.
Shapes: the ``--model-preset``'s projections (default Qwen2.5-1.5B) and Qwen3-30B-A3B's experts
(hidden 2048, moe_intermediate 768); quick: two tiny shapes at M = 1, 8, no timings (the CPU runs
the kernels in the Triton interpreter), bits and bytes only. ``--items headline``: both fp8 formats
on the preset's k/v and gate/up projections at M = 1, 16, 64, 4096 (quick: the tiny gate/up at M =
1, 8), the rows the GPU check measures first against ``torch._scaled_mm``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from tqdm import tqdm

from invariant_infer.kernels import QuantizedWeight, quantize_activations, quantized_linear

from .matmul import DEFAULT_FAMILY, DEFAULT_PRESET, model_shapes
from .stock_kernels import device_label, fp8_scaled_mm_refusal, importable
from .timing import Run, free_memory, time_ms

FORMATS = {"fp8_block": "FP8_BLOCK", "fp8_channel": "FP8_DYNAMIC", "int4_w4a16": "W4A16"}
MS, QUICK_MS = (1, 16, 64, 2048, 4096), (1, 8)
HEADLINE_SHAPES, QUICK_HEADLINE_SHAPES = ("k/v", "gate/up"), ("gate/up",)
HEADLINE_FORMATS = ("fp8_channel", "fp8_block")
HEADLINE_MS, QUICK_HEADLINE_MS = (1, 16, 64, 4096), (1, 8)
FP8_MAX = 448.0  # float8_e4m3fn
BLOCK = 128
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


def _block_max(t: torch.Tensor) -> torch.Tensor:
    """max |t| over each 128x128 block of t [N, K] (edge blocks partial): [ceil(N/128), ceil(K/128)]."""
    n, k = t.shape
    padded = t.abs().new_zeros(-(-n // BLOCK) * BLOCK, -(-k // BLOCK) * BLOCK)
    padded[:n, :k] = t.abs()
    return padded.unflatten(0, (-1, BLOCK)).unflatten(2, (-1, BLOCK)).amax(dim=(1, 3))


def _expand_blocks(scale: torch.Tensor, n: int, k: int) -> torch.Tensor:
    return scale.repeat_interleave(BLOCK, 0)[:n].repeat_interleave(BLOCK, 1)[:, :k]


def torch_fp8_weight(w: torch.Tensor, fmt: str) -> QuantizedWeight:
    """``w`` quantized to fp8 in torch as compressed-tensors' FP8_DYNAMIC / FP8_BLOCK presets store it
    (the same bits): a scale in w's dtype of max |w| / 448 per output channel ([N, 1]) or per 128x128 block."""
    n, k = w.shape
    wf = w.float()
    amax = _block_max(wf) if fmt == "fp8_block" else wf.abs().amax(dim=1, keepdim=True)
    scale = (amax / FP8_MAX).clamp(min=1e-12).to(w.dtype)
    full = _expand_blocks(scale, n, k) if fmt == "fp8_block" else scale
    data = (w / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)  # divided in w's dtype, as compressed-tensors
    return QuantizedWeight("fp8", data, scale, (n, k), block=fmt == "fp8_block")


def torch_dequantized(weight: QuantizedWeight) -> torch.Tensor:
    """An fp8 weight back to bf16 in torch (what the stock fallback multiplies)."""
    n, k = weight.shape
    scale = weight.scale.float()
    full = _expand_blocks(scale, n, k) if weight.block else scale
    return (weight.data.float() * full).to(torch.bfloat16)


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
    scale = (xg.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    q = (xg / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).flatten(1)
    return q, scale.squeeze(-1)


DECOMPRESS = "compressed-tensors decompress + F.linear"
TORCH_DEQUANTIZE = "torch dequantize + F.linear"
SCALED_MM = "torch._scaled_mm"
SCALED_MM_PADDED = "torch._scaled_mm (rows padded to a multiple of 16)"  # where it refuses other Ms, as vLLM pads


def _rows_padded(x: torch.Tensor, multiple: int = 16) -> torch.Tensor:
    return F.pad(x, (0, 0, 0, -x.shape[0] % multiple))


def stock_fns(weight: QuantizedWeight, fmt: str, device, dequantize, fallback_name: str = DECOMPRESS):
    """({name: x -> y} of the stock paths this device runs, the preferred first, why
    ``torch._scaled_mm`` is not among them or None): ``torch._scaled_mm`` for fp8 on a GPU of compute
    capability 8.9 or more (as is, then on rows padded to a multiple of 16 for an M it refuses), then
    the fallback, ``F.linear`` on ``dequantize()`` (always there, last)."""
    def dequantize_matmul(x):
        return F.linear(x, dequantize().to(x.dtype))

    fallback = {fallback_name: dequantize_matmul}
    if fmt == "int4_w4a16":
        return fallback, None
    refusal = fp8_scaled_mm_refusal(torch.device(device))
    if refusal:
        return fallback, refusal
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
            got, want = scaled_mm(probe).float(), dequantize_matmul(probe).float()
        if (got - want).abs().max() > 0.1 * want.abs().max():
            return fallback, f"{SCALED_MM} reads these {fmt} scales otherwise (off the dequantized GEMM's output)"
        return {SCALED_MM: scaled_mm, SCALED_MM_PADDED: lambda x: scaled_mm(_rows_padded(x))[:x.shape[0]],
                **fallback}, None
    except (RuntimeError, TypeError, NotImplementedError) as exc:  # this torch or GPU: no such scaling
        return fallback, f"{SCALED_MM} raised {type(exc).__name__}: {exc}"[:300]


def _first_that_runs(stocks: dict, x: torch.Tensor):
    """(name, fn, fn(x), why the preferred ones did not run or None) of the first stock path that
    runs at this M (e.g. _scaled_mm's size limits)."""
    why = None
    for name, fn in list(stocks.items())[:-1]:
        try:
            return name, fn, fn(x), None
        except (RuntimeError, TypeError, NotImplementedError) as exc:
            why = why or f"{name} raised {type(exc).__name__}: {exc}"[:300]
    name, fn = list(stocks.items())[-1]
    return name, fn, fn(x), why


def _alone_equal(fn, x: torch.Tensor, y: torch.Tensor) -> bool:
    rows = sorted({0, x.shape[0] // 2, x.shape[0] - 1})
    return all(torch.equal(fn(x[r:r + 1])[0], y[r]) for r in rows)


def shape_sets(ctx: Run, family: str, preset: str) -> dict:
    if ctx.quick:
        return QUICK_SHAPES
    dense = model_shapes(family, preset)
    return {f"{family}:{preset}": {name: dense[name][:2] for name in DENSE_PROJECTIONS},
            "qwen3_moe:qwen3-30b-a3b": EXPERT_SHAPES}


def items(ctx: Run, family: str, preset: str, ms=None) -> list[tuple]:
    """(model, shape, format, M) of this run, grouped by weight: the grid for ``ctx.items``, or
    every format at ``ms`` when given."""
    sets = shape_sets(ctx, family, preset)
    first = next(iter(sets))  # the preset's own projections (quick: the tiny shapes)

    def grid(names, formats, m_values):  # names: the shapes taken of the preset's own set; None: every shape
        return [(model, name, fmt, m) for model, shapes in sets.items() for name in shapes
                if names is None or (model == first and name in names) for fmt in formats for m in m_values]
    if ms:
        return grid(None, FORMATS, ms)
    full, quick = grid(None, FORMATS, MS), grid(None, FORMATS, QUICK_MS)
    head = grid(HEADLINE_SHAPES, HEADLINE_FORMATS, HEADLINE_MS)
    quick_head = grid(QUICK_HEADLINE_SHAPES, HEADLINE_FORMATS, QUICK_HEADLINE_MS)
    return ctx.grid(full, quick, head, quick_head)


def _time(ctx: Run, fn) -> float | None:
    if not ctx.on_gpu:
        return None  # the interpreter's times say nothing about a GPU's
    return time_ms(fn, ctx.device, reps=10, warmup=1, flush_l2=True)


def _skipped_row(model, name, fmt, m, n, k, device, reason: str) -> dict:
    row = {key: None for key in ("stock", "invariant_ms", "stock_ms", "bf16_ms", "ratio", "ratio_to_bf16",
                                 "weight_bytes", "bytes_ratio", "invariant_max_abs_diff_to_stock",
                                 "invariant_max_abs_diff_to_bf16", "invariant_alone_bitwise_equal",
                                 "stock_alone_bitwise_equal", "stock_skipped")}
    return {**row, "model": model, "shape": name, "format": fmt, "scheme": FORMATS[fmt], "M": m, "N": n, "K": k,
            "bf16_weight_bytes": n * k * 2, "device": device, "skipped": reason}


def _quantized(w: torch.Tensor, fmt: str, compressed_tensors_missing: str | None):
    """(the invariant weight, () -> the dequantized weight, the stock fallback's name), or None when
    this format needs compressed-tensors and it is missing."""
    if compressed_tensors_missing is None:
        compressed, scheme, compressor = compressed_weight(w, FORMATS[fmt])
        weight = invariant_weight(compressed, fmt, tuple(w.shape))
        return weight, lambda: compressor.decompress(compressed, scheme)["weight"], DECOMPRESS
    if fmt == "int4_w4a16":
        return None
    weight = torch_fp8_weight(w, fmt)
    return weight, lambda: torch_dequantized(weight), TORCH_DEQUANTIZE


def _fp8_refusal(ctx: Run) -> str | None:
    """Why the invariant fp8 GEMM cannot run on this GPU (compute capability below 8.9), or None."""
    if not ctx.on_gpu:
        return None
    refusal = fp8_scaled_mm_refusal(ctx.device)
    return refusal and refusal.replace(SCALED_MM, "fp8")


def run(ctx: Run, ms=None, family: str = DEFAULT_FAMILY, preset: str = DEFAULT_PRESET, **_) -> dict:
    """The ``quant`` section: one row per (model, shape, format, M)."""
    gen = torch.Generator().manual_seed(0)
    shapes = {(model, name): nk for model, by_name in shape_sets(ctx, family, preset).items()
              for name, nk in by_name.items()}
    groups: dict[tuple, list] = {}
    for model, name, fmt, m in items(ctx, family, preset, ms):
        groups.setdefault((model, name, fmt), []).append(m)
    _, missing = importable("compressed_tensors")
    device, fp8_refusal = device_label(ctx.device), _fp8_refusal(ctx)
    rows = []
    for (model, name, fmt), group_ms in tqdm(groups.items(), desc="quant", leave=False):
        if ctx.out_of_time(f"quant {model} {name} {fmt}"):
            continue
        n, k = shapes[model, name]
        skip = fp8_refusal if fmt != "int4_w4a16" else None
        try:
            w = (torch.randn(n, k, generator=gen) * k ** -0.5).to(ctx.device, torch.bfloat16)
            x_all = torch.randn(max(group_ms), k, generator=gen).to(ctx.device, torch.bfloat16)
            quantized = None if skip else _quantized(w, fmt, missing)
            if quantized is None:
                rows += [_skipped_row(model, name, fmt, m, n, k, device, skip or missing) for m in group_ms]
                continue
            weight, dequantize, fallback_name = quantized
            inv = invariant_fn(weight, fmt)
            stocks, stock_skipped = stock_fns(weight, fmt, ctx.device, dequantize, fallback_name)
            for m in group_ms:
                x = x_all[:m]
                with torch.no_grad():
                    y_inv, y_bf16 = inv(x), F.linear(x, w)
                    stock_name, stock, y_stock, refused_at_m = _first_that_runs(stocks, x)
                    row = {"model": model, "shape": name, "format": fmt, "scheme": FORMATS[fmt], "M": m, "N": n,
                           "K": k, "device": device, "stock": stock_name,
                           "stock_skipped": stock_skipped or refused_at_m,
                           "skipped": None, "invariant_ms": _time(ctx, lambda: inv(x)),
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
        except Exception as exc:  # one failing shape must not end a one-shot GPU run
            ctx.failed(f"quant {model} {name} {fmt}", exc)
    free_memory(ctx.device)
    return {"quant": rows}
