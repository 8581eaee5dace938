"""Linear layers at a model preset's shapes (default Qwen2.5-1.5B): torch.nn.functional.linear
(cuBLAS) vs invariant_infer.kernels.linear, timed back to back per (shape, M). The headline Ms are
decode (1), small batches (16, 64) and prefill (4096)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import AutoModelForCausalLM

from invariant_infer.model.families import FAMILIES
from invariant_infer.kernels import linear
from invariant_infer.kernels.configs import row_parallel_config
from invariant_infer.testing.random_checkpoints import random_config

from .stock_kernels import device_label
from .timing import Run, time_ms

DEFAULT_FAMILY, DEFAULT_PRESET = "qwen2", "qwen2.5-1.5b"
# Shape name -> the projections it stands for (k and v, gate and up have one shape each).
PROJECTIONS = {"q": "self_attn.q_proj", "k/v": "self_attn.k_proj", "o": "self_attn.o_proj",
               "gate/up": "mlp.gate_proj", "down": "mlp.down_proj"}
# The row-parallel ones run the K tree that tensor parallelism splits, as in the patched model.
ROW_PARALLEL = tuple(name for name, path in PROJECTIONS.items() if path in FAMILIES[DEFAULT_FAMILY].row_parallel)
MS = (1, 8, 16, 32, 64, 128, 512, 2048, 4096, 8192)
QUICK_MS = (1, 8, 32)
HEADLINE_MS, QUICK_HEADLINE_MS = (1, 16, 64, 4096), (1, 8)  # decode, small batches, prefill (--items headline)
STOCK = "F.linear"  # cuBLAS(Lt) on a GPU


def model_shapes(family: str = DEFAULT_FAMILY, preset: str = DEFAULT_PRESET) -> dict:
    """name -> (N, K, bias) of the preset's projections, y[M, N] = x[M, K] @ W[N, K]^T (+ b).

    Read off one decoder layer built on the meta device (no memory), so head_dim, q/k/v bias
    (Qwen2), attention_bias / mlp_bias (Llama) and the like are what the family's own modules use."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(random_config(family, preset, num_hidden_layers=1))
    found = FAMILIES[family].projections(model.model.layers[0])
    shapes = {}
    for name, path in PROJECTIONS.items():
        module = found[path]
        shapes[name] = (module.out_features, module.in_features, module.bias is not None)
    head = model.get_output_embeddings()
    shapes["lm_head"] = (head.out_features, head.in_features, head.bias is not None)
    return shapes


def quick_shapes(shapes: dict) -> dict:
    """Quick (CPU interpreter): N and K divided by 16 (at least 16)."""
    return {name: (max(16, n // 16), max(16, k // 16), bias) for name, (n, k, bias) in shapes.items()}


def max_abs_diff(a: torch.Tensor, b: torch.Tensor, chunk: int = 1024) -> float:
    """max |a - b| in fp32, a row chunk at a time (lm_head outputs reach gigabytes)."""
    a2, b2 = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
    best = 0.0
    for i in range(0, a2.shape[0], chunk):
        best = max(best, (a2[i:i + chunk].float() - b2[i:i + chunk].float()).abs().max().item())
    return best


def run(ctx: Run, shapes: dict | None = None, ms=None, dtype=torch.bfloat16, family: str = DEFAULT_FAMILY,
        preset: str = DEFAULT_PRESET) -> dict:
    if shapes is None:
        shapes = model_shapes(family, preset)
        shapes = quick_shapes(shapes) if ctx.quick else shapes
    ms = tuple(ms or ctx.grid(MS, QUICK_MS, HEADLINE_MS, QUICK_HEADLINE_MS))
    rows = []
    items = [(name, m) for name in shapes for m in ms]
    gen = torch.Generator(device=ctx.device).manual_seed(0)
    weights = {}
    refs = {}  # name -> (stock row 0, invariant row 0) at M=1
    for name, m in tqdm(items, desc="matmul", leave=False):
        if ctx.out_of_time(f"{name} M={m}"):
            continue
        n, k, has_bias = shapes[name]
        try:
            if name not in weights:
                weights.clear()
                w = torch.randn(n, k, generator=gen, device=ctx.device, dtype=dtype) * k ** -0.5
                b = torch.randn(n, generator=gen, device=ctx.device, dtype=dtype) * 0.02 if has_bias else None
                x_all = torch.randn(max(ms), k, generator=gen, device=ctx.device, dtype=dtype)
                weights[name] = (w, b, x_all)
            w, b, x_all = weights[name]
            x = x_all[:m]
            config = row_parallel_config(ctx.device.type, dtype, n, k) if name in ROW_PARALLEL else None
            stock_fn, inv_fn = (lambda: F.linear(x, w, b)), (lambda: linear(x, w, b, config=config))
            y_stock, y_inv = stock_fn(), inv_fn()  # also the warm-up (Triton compiles here)
            stock_ms = time_ms(stock_fn, ctx.device, reps=3, warmup=0, flush_l2=True)
            inv_ms = time_ms(inv_fn, ctx.device, reps=3 if ctx.on_gpu else 1, warmup=0, flush_l2=True)
            if m == ms[0]:
                refs[name] = (y_stock[0].clone(), y_inv[0].clone())
            flops = 2.0 * m * n * k
            rows.append({
                "shape": name, "M": m, "N": n, "K": k, "bias": has_bias, "dtype": str(dtype).removeprefix("torch."),
                "device": device_label(ctx.device), "stock": STOCK,
                "stock_ms": stock_ms, "invariant_ms": inv_ms,
                "stock_tflops": flops / (stock_ms * 1e-3) / 1e12, "invariant_tflops": flops / (inv_ms * 1e-3) / 1e12,
                "ratio": inv_ms / stock_ms,
                "max_abs_diff": max_abs_diff(y_inv, y_stock),
                # Row 0 of this M-row product, bitwise, against row 0 computed with M = ms[0].
                "row0_reference_M": ms[0],
                "stock_row0_equal": bool(torch.equal(y_stock[0], refs[name][0])) if name in refs else None,
                "invariant_row0_equal": bool(torch.equal(y_inv[0], refs[name][1])) if name in refs else None,
            })
            del y_stock, y_inv
        except Exception as exc:  # one failing shape must not end a one-shot GPU run
            ctx.failed(f"{name} M={m}", exc)
    return {"matmul": rows}
