"""Gated DeltaNet's scan (the gated delta rule): the invariant chunked kernel vs transformers' stock
torch fallbacks and, when importable, flash-linear-attention's kernels, on the same inputs.

Heads as Qwen3.5's and Qwen3-Next's linear-attention layers (``HEADS``: 16 key heads and 32 value heads
of 128; quick: ``QUICK_HEADS``), bf16 inputs N(0, 1), ``a`` and ``b`` N(0, 1), ``dt_bias`` 1 and a
slow decay, A = exp(A_log) in [0.001, 0.05] (the models initialise A in [0, 16], whose state forgets a
token within a few steps), so the state carries over hundreds of tokens. Cases:
  * ``prefill`` T tokens of one sequence from an empty state: the invariant kernel; stock
    ``torch_chunk_gated_delta_rule`` (chunks of 64); fla's ``chunk_gated_delta_rule``.
  * ``decode`` B sequences of ``DECODE_CONTEXT`` tokens each take one token: the invariant kernel runs
    each sequence's rows since its last chunk boundary with the new one appended (as the model and
    the engine run a decode step); stock ``torch_recurrent_gated_delta_rule`` (one step from the
    state); fla's ``fused_recurrent_gated_delta_rule``.
Each row: the time, the invariant time / this implementation's (above 1: invariant slower), the
max |output - stock torch's|, and whether a decode step's output equals the same token's row of one
prefill over the whole context, bitwise (``decode_equals_prefill``: true by construction for the
invariant kernel; the stock decode is another computation).

End to end (``gdn_prefill`` and ``gdn_decode``, the ``e2e`` section's rows and columns): a Qwen3.5
model with transformers' default ``Qwen3_5TextConfig`` widths (hidden 4096, 16 query / 4 KV heads of
256, Gated DeltaNet heads as ``HEADS``, vocabulary 248320) cut to ``MODEL_LAYERS`` layers (three Gated
DeltaNet layers, then one attention layer, as the released models), random weights, stock then
``make_invariant``; quick: the family's ``tiny`` preset.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from tqdm import tqdm

from invariant_infer.kernels import chunk_gated_delta_rule
from invariant_infer.kernels.gated_delta_rule import CHUNK

from . import e2e
from .stock_kernels import device_label, importable
from .timing import Run, free_memory, time_ms

HEADS = dict(key_heads=16, value_heads=32, head_dim=128)
QUICK_HEADS = dict(key_heads=2, value_heads=4, head_dim=16)
PREFILL, QUICK_PREFILL = (2048, 8192), (70, 130)
DECODE_BATCHES, QUICK_DECODE_BATCHES = (1, 64), (1, 4)
DECODE_CONTEXT, QUICK_DECODE_CONTEXT = 2048 + 37, 64 + 37  # 37 rows past the last chunk boundary
IMPLEMENTATIONS = ("invariant", "stock_torch", "fla")
MODEL_FAMILY, MODEL_LAYERS = "qwen3_5_text", 8
# (batch, tokens) of one forward; (batch, prompt, new tokens) of greedy generate. Quick: prompts past
# the 64-token chunk boundary.
MODEL_PREFILL, QUICK_MODEL_PREFILL = ((1, 2048), (8, 2048)), ((1, 70),)
MODEL_DECODE, QUICK_MODEL_DECODE = ((1, 2048, 32), (32, 512, 32)), ((2, 60, 6),)


def model_config(quick: bool):
    """The end-to-end rows' config (see the module docstring)."""
    from transformers import Qwen3_5TextConfig  # noqa: PLC0415
    if quick:
        return e2e.preset_config(MODEL_FAMILY, "tiny")[0]
    layer_types = ["linear_attention"] * 3 + ["full_attention"]
    return Qwen3_5TextConfig(num_hidden_layers=MODEL_LAYERS, layer_types=layer_types * (MODEL_LAYERS // 4))


def _stock_functions():
    from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen3_5  # noqa: PLC0415
    return qwen3_5.torch_chunk_gated_delta_rule, qwen3_5.torch_recurrent_gated_delta_rule


def _fla_functions():
    """(fla's (chunk, fused recurrent) gated delta rule, None), or (None, why not: "fla.ops.gated_delta_rule
    not importable", with the error where fla is installed but its import fails here)."""
    module, why = importable("fla.ops.gated_delta_rule")
    if module is None:
        return None, why
    return (module.chunk_gated_delta_rule, module.fused_recurrent_gated_delta_rule), None


def make_inputs(heads: dict, sequences: int, tokens: int, device, seed: int = 0) -> dict:
    """q, k [S, T, Hk, D], v [S, T, Hv, D], a, b [S, T, Hv] (bf16), A_log, dt_bias [Hv] (fp32)."""
    hk, hv, d = heads["key_heads"], heads["value_heads"], heads["head_dim"]
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device, torch.bfloat16)
    return dict(q=randn(sequences, tokens, hk, d), k=randn(sequences, tokens, hk, d), v=randn(sequences, tokens, hv, d),
                a=randn(sequences, tokens, hv), b=randn(sequences, tokens, hv),
                a_log=torch.log(torch.empty(hv).uniform_(0.001, 0.05, generator=gen)).to(device),
                dt_bias=torch.ones(hv, device=device))


def _gates(x: dict, rows: slice):
    g = -x["a_log"].exp() * F.softplus(x["a"][:, rows].float() + x["dt_bias"])
    return g, x["b"][:, rows].sigmoid()


def _repeat_heads(x: dict, rows: slice):
    group = x["v"].shape[2] // x["q"].shape[2]
    return (x["q"][:, rows].repeat_interleave(group, dim=2), x["k"][:, rows].repeat_interleave(group, dim=2),
            x["v"][:, rows])


def invariant_scan(x: dict, start: int, end: int, out_from: int, state: torch.Tensor) -> torch.Tensor:
    """Every sequence's rows [start, end) (start at a chunk boundary) from ``state``; outputs
    [S * (end - start), Hv, D], written from row ``out_from`` of each sequence."""
    s, rows = x["q"].shape[0], end - start
    flat = {name: x[name][:, start:end].reshape(s * rows, *x[name].shape[2:]) for name in ("q", "k", "v", "a", "b")}
    first = torch.arange(s, device=state.device, dtype=torch.int32) * rows
    return chunk_gated_delta_rule(flat["q"], flat["k"], flat["v"], flat["a"], flat["b"], x["a_log"], x["dt_bias"],
                                  first, first + rows, state, out_from=first + (out_from - start))


def prefill_fns(x: dict, fla) -> dict:
    """implementation -> () -> outputs [S, T, Hv, D] of one prefill from an empty state."""
    s, t = x["q"].shape[:2]
    hv, d = x["v"].shape[2:]
    whole = slice(0, t)

    def invariant():
        state = torch.zeros(s, hv, x["q"].shape[3], d, device=x["q"].device)
        return invariant_scan(x, 0, t, 0, state).view(s, t, hv, d)

    def stock():
        g, beta = _gates(x, whole)
        return _stock_functions()[0](*_repeat_heads(x, whole), g, beta, chunk_size=CHUNK,
                                     use_qk_l2norm_in_kernel=True)[0]

    fns = {"invariant": invariant, "stock_torch": stock}
    if fla is not None:
        def fla_chunk():
            g, beta = _gates(x, whole)
            return fla[0](*_repeat_heads(x, whole), g=g, beta=beta, use_qk_l2norm_in_kernel=True)[0]
        fns["fla"] = fla_chunk
    return fns


def decode_fns(x: dict, fla) -> dict:
    """implementation -> () -> the last token's output [S, Hv, D], each sequence holding its first
    T - 1 tokens: the invariant boundary state and unfinished rows, the stock final state."""
    s, t = x["q"].shape[:2]
    hv, d, dk = x["v"].shape[2], x["v"].shape[3], x["q"].shape[3]
    boundary = (t - 1) // CHUNK * CHUNK
    before = torch.zeros(s, hv, dk, d, device=x["q"].device)
    if boundary:
        invariant_scan(x, 0, boundary, 0, before)  # the state at the last chunk boundary
    prefix, last = slice(0, t - 1), slice(t - 1, t)
    g, beta = _gates(x, prefix)
    stock_state = _stock_functions()[0](*_repeat_heads(x, prefix), g, beta, chunk_size=CHUNK,
                                        use_qk_l2norm_in_kernel=True, output_final_state=True)[1]

    def invariant():
        state = before.clone()
        return invariant_scan(x, boundary, t, t - 1, state).view(s, t - boundary, hv, d)[:, -1]

    def stock():
        g, beta = _gates(x, last)
        return _stock_functions()[1](*_repeat_heads(x, last), g, beta, initial_state=stock_state.clone(),
                                     output_final_state=True, use_qk_l2norm_in_kernel=True)[0][:, 0]

    fns = {"invariant": invariant, "stock_torch": stock}
    if fla is not None:
        def fla_decode():
            g, beta = _gates(x, last)
            return fla[1](*_repeat_heads(x, last), g=g, beta=beta, initial_state=stock_state.float().clone(),
                          output_final_state=True, use_qk_l2norm_in_kernel=True)[0][:, 0]
        fns["fla"] = fla_decode
    return fns


def run(ctx: Run, heads: dict | None = None, **_preset) -> dict:
    """The ``gdn`` section (its heads are Qwen3.5's whatever ``--model-preset`` says)."""
    heads = heads or (QUICK_HEADS if ctx.quick else HEADS)
    fla, fla_missing = _fla_functions()
    cases = [("prefill", 1, t) for t in (QUICK_PREFILL if ctx.quick else PREFILL)]
    context = QUICK_DECODE_CONTEXT if ctx.quick else DECODE_CONTEXT
    cases += [("decode", b, context) for b in (QUICK_DECODE_BATCHES if ctx.quick else DECODE_BATCHES)]
    rows = []
    for case, sequences, tokens in tqdm(cases, desc="gdn", leave=False):
        if ctx.out_of_time(f"gdn {case} B={sequences} T={tokens}"):
            continue
        x = make_inputs(heads, sequences, tokens, ctx.device)
        with torch.no_grad():
            fns = (prefill_fns if case == "prefill" else decode_fns)(x, fla)
            whole = prefill_fns(x, None) if case == "decode" else fns
            one_forward = {name: whole[name]()[:, -1] for name in ("invariant", "stock_torch")}
            reference = fns["stock_torch"]().float()
        times, batch_rows = {}, []
        for implementation in IMPLEMENTATIONS:
            row = {"case": case, "implementation": implementation, "sequences": sequences, "tokens": tokens,
                   **heads, "device": device_label(ctx.device), "skipped": None, "ms": None, "tokens_per_s": None,
                   "max_abs_diff_to_stock": None, "decode_equals_prefill": None}
            batch_rows.append(row)
            if implementation not in fns:
                row["skipped"] = fla_missing
                continue
            try:
                with torch.no_grad():
                    out = fns[implementation]()
                    ms = time_ms(fns[implementation], ctx.device, reps=10 if ctx.on_gpu else 1,
                                 warmup=1 if ctx.on_gpu else 0)
            except Exception as exc:  # noqa: BLE001  (e.g. a kernel the device cannot run)
                ctx.failed(f"gdn {implementation} {case}", exc)
                row["skipped"] = f"{type(exc).__name__}: {exc}"[:300]
                continue
            times[implementation] = ms
            new_tokens = sequences * (tokens if case == "prefill" else 1)
            row.update(ms=ms, tokens_per_s=new_tokens / (ms * 1e-3),
                       max_abs_diff_to_stock=(out.float() - reference).abs().max().item())
            if case == "decode" and implementation in one_forward:
                row["decode_equals_prefill"] = torch.equal(out.to(one_forward[implementation].dtype),
                                                           one_forward[implementation])
        for row in batch_rows:
            mine, theirs = times.get("invariant"), times.get(row["implementation"])
            row["invariant_time_ratio"] = mine / theirs if mine and theirs and row["implementation"] != "invariant" \
                else None
        rows += batch_rows
        del x, fns, whole, reference
        free_memory(ctx.device)
    model = e2e.run(ctx, config=model_config(ctx.quick),
                    score_shapes=QUICK_MODEL_PREFILL if ctx.quick else MODEL_PREFILL,
                    decode_shapes=QUICK_MODEL_DECODE if ctx.quick else MODEL_DECODE)
    name = f"{MODEL_FAMILY}:tiny" if ctx.quick else f"{MODEL_FAMILY}:transformers-default-widths-{MODEL_LAYERS}-layers"
    for row in model["e2e"] + model["decode"]:
        row["preset"] = name
    return {"gdn": rows, "gdn_prefill": model["e2e"], "gdn_decode": model["decode"]}
