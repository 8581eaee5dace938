"""The plan report: for each supported family's real widths, each kernel of a layer and each M, the
programs a GPU launch runs (and waves of SMs), bytes moved, FLOPs and the roofline bound, read
before a GPU measures anything.

    python -m benchmarks plan                               # every family, H100 and H200
    python -m benchmarks plan --gpu h100 --families qwen2.5-1.5b --m 1,16
    python -m benchmarks plan --write-doc                   # and replace the tables in docs/benchmarks.md

Programs come from the code, live: each kernel's public function is called at the family's shapes
on CPU tensors under ``invariant_infer.kernels.launch_recording.recorded_launches`` with the GPU's
``TileTarget`` (its SM count picks the schedules that depend on it), which records each launch's
grid instead of running it (inputs are allocated, never written). So a change of tiles, split-K or
split-KV shows up here when the report is rerun. A call that launches several kernels (parallel K
chunks and their combine, a split-KV pass and its merge) lists each launch's programs; waves are
the largest launch's programs over the SMs.

Bytes and FLOPs are analytic, from the shapes (bf16: 2 bytes an element), ``plan_costs``:
  * GEMM x [M, K] @ W[N, K]^T: 2·M·N·K FLOPs; bytes 2·(M·K + N·K + M·N) (the fused silu·up
    prologue of down_proj reads two [M, K] inputs; a grouped MoE GEMM over T = M·top_k routed rows
    reads the weights of min(E, T) experts);
  * RMSNorm over [R, N]: 4·R·N FLOPs, 2·(2·R·N + N) bytes; its backward (d x and d weight, training):
    10·R·N FLOPs, 2·(3·R·N + 2·N) bytes plus the fp32 group sums (4·N·R / 64, written and read);
  * causal attention prefill of one sequence of M tokens: 4·Hq·D per (query, visible key) pair,
    M·(M + 1) / 2 pairs (a window of w keys: each query sees at most w); bytes 2·(2·M·Hq·D + 2·M·Hkv·D);
  * decode attention, B sequences of context L (a window caps L): 4·B·Hq·D·L FLOPs;
    bytes 2·(2·B·L·Hkv·D + 2·B·Hq·D);
  * act(gate) * up over [R, N] (clamped swiglu, gelu_tanh): 6·R·N bytes, 16·R·N FLOPs;
  * Gated DeltaNet over T tokens (chunks of C = 64): T·Hv·(6·Dk·Dv + 2·C·(Dk + Dv)) FLOPs (state
    read, delta and update per token; the chunk's intra-chunk products); bytes 2·T·(2·Hk·Dk +
    2·Hv·Dv + 2·Hv) + 8·Hv·Dk·Dv (the fp32 state in and out).
The bound is max(bytes / bandwidth, FLOPs / peak) in µs, on the GPUs of ``GPUS`` (dense bf16 peak,
HBM bandwidth: the vendors' SXM figures).

The families' widths (``FAMILIES``): Qwen2.5-1.5B, Llama-3.1-8B, Qwen3-8B and gpt-oss-20b from this
project's presets (``invariant_infer.model.families``, copied from the released config.json files);
Qwen2.5-7B from ``invariant_infer.testing.kernel_variants`` (its released config.json); Qwen3.5-27B
and Gemma-3-12B from memory of their released config.json files (check them before relying on a
row: Qwen3.5-27B hidden 5120, MLP 17408, 24 query / 4 KV heads of 256, Gated DeltaNet 16 key / 48
value heads of 128; Gemma-3-12B hidden 3840, MLP 15360, 16 query / 8 KV heads of 256, window 1024).
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch

from .doc_sections import DOC, replace_section
from .plan_costs import (Cost, attention_decode_cost, attention_prefill_cost, gated_delta_rule_cost, gemm_cost,
                         elementwise_cost, grouped_gemm_cost, rms_norm_backward_cost, rms_norm_cost)

BEGIN, END = "<!-- plan-report:begin -->", "<!-- plan-report:end -->"
DTYPE = torch.bfloat16
M_VALUES = (1, 16, 64, 4096)
DECODE_CONTEXT = 8192
DECODE_BATCHES = (1, 16)


@dataclass(frozen=True)
class Gpu:
    name: str
    sms: int
    bandwidth: float  # HBM bytes per second
    peak: float       # dense bf16 FLOP/s


GPUS = {"h100": Gpu("H100 SXM", 132, 3.35e12, 989e12), "h200": Gpu("H200 SXM", 132, 4.8e12, 989e12)}


@dataclass(frozen=True)
class Family:
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    qk_norm: bool = False          # RMSNorm over each head's D (Qwen3, Gemma 3, Qwen3.5)
    gated_attention: bool = False  # q_proj also yields a sigmoid gate (Qwen3.5's full attention)
    gelu: bool = False             # gelu_tanh(gate) * up written, then down (Gemma 3); else fused silu
    window: int = 0                # the windowed layers' window (0: none)
    sinks: bool = False
    experts: int = 0               # MoE: experts, experts per token, and each expert's MLP width
    top_k: int = 0
    gdn: tuple[int, int, int, int] | None = None  # Gated DeltaNet: key heads, value heads, Dk, Dv


FAMILIES: dict[str, Family] = {
    "qwen2.5-1.5b": Family(1536, 8960, 12, 2, 128, 151936),
    "qwen2.5-7b": Family(3584, 18944, 28, 4, 128, 152064),
    "llama-3.1-8b": Family(4096, 14336, 32, 8, 128, 128256),
    "qwen3-8b": Family(4096, 12288, 32, 8, 128, 151936, qk_norm=True),
    "gpt-oss-20b": Family(2880, 2880, 64, 8, 64, 201088, window=128, sinks=True, experts=32, top_k=4),
    "qwen3.5-27b": Family(5120, 17408, 24, 4, 256, 248320, qk_norm=True, gated_attention=True,
                          gdn=(16, 48, 128, 128)),
    "gemma-3-12b": Family(3840, 15360, 16, 8, 256, 262208, qk_norm=True, gelu=True, window=1024),
}


@dataclass
class Row:
    family: str
    kernel: str
    kind: str                # gemm, norm, attention, decode, gdn, elementwise
    m: str                   # "1", "4096", or "B=16 L=8192" for decode
    cost: Cost
    grids: list = field(default_factory=list)  # (kernel name, grid) per launch, in order
    tile: str = ""           # a GEMM's tile: its largest tiled launch's BLOCK_M x BLOCK_N x BLOCK_K, warps, stages

    def programs(self) -> int:
        return max((grid[0] * grid[1] * grid[2] for _, grid in self.grids), default=0)

    def programs_text(self) -> str:
        return "+".join(str(grid[0] * grid[1] * grid[2]) for _, grid in self.grids) or "0"

    def waves(self, gpu: Gpu) -> float:
        return self.programs() / gpu.sms

    def bound_us(self, gpu: Gpu) -> float:
        return roofline_us(self.cost, gpu)

    def wants_a_wave(self) -> bool:
        """A row the design wants at one full wave at least: a GEMM at M <= 64, decode at batch 1."""
        return (self.kind == "gemm" and int(self.m) <= 64) or (self.kind == "decode" and self.m.startswith("B=1 "))


def roofline_us(cost: Cost, gpu: Gpu) -> float:
    """max(bytes / bandwidth, FLOPs / peak), in microseconds."""
    return max(cost.bytes / gpu.bandwidth, cost.flops / gpu.peak) * 1e6


def _blank(*shape, dtype=DTYPE) -> torch.Tensor:
    """An input never written: a large one costs address space, not memory."""
    return torch.empty(shape, dtype=dtype)


def _ints(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def layer_calls(family: Family, m: int) -> list[tuple[str, str, Cost, Callable[[], object]]]:
    """(kernel row, kind, cost, call) for each kernel of one layer (and lm_head) at M tokens, as the
    patched model calls them (``invariant_infer.model.layer_forwards``: row-parallel K trees for o_proj and
    down_proj, silu * up fused into down_proj's prologue)."""
    from invariant_infer.kernels import (attention, chunk_gated_delta_rule, clamped_swiglu, gelu_tanh_mul,
                                         grouped_linear, linear, rms_norm)
    from invariant_infer.kernels.configs import row_parallel_config
    from invariant_infer.kernels.fused_linear import silu_mul_linear
    from invariant_infer.kernels.rms_norm_autograd import rms_norm_backward

    f = family
    h, d = f.hidden, f.head_dim
    calls = []

    def add(name, kind, cost, function, *args, **kwargs):
        calls.append((name, kind, cost, partial(function, *args, **kwargs)))

    def gemm(name, n, k, row_parallel=False):
        config = row_parallel_config("cpu", DTYPE, n, k) if row_parallel else None
        add(f"{name} {n}x{k}", "gemm", gemm_cost(m, n, k), linear, _blank(m, k), _blank(n, k), config=config)

    def norm(name, rows, n):
        label = f"{name} {n}" + (f" ({rows // m} rows a token)" if rows != m else "")
        add(label, "norm", rms_norm_cost(rows, n), rms_norm, _blank(rows, n), _blank(n), 1e-6)

    norm("input_layernorm", m, h)
    gemm("q_proj", f.heads * d * (2 if f.gated_attention else 1), h)
    gemm("k_proj", f.kv_heads * d, h)
    gemm("v_proj", f.kv_heads * d, h)
    if f.qk_norm:
        norm("q_norm", m * f.heads, d)
    qkv = (_blank(1, f.heads, m, d), _blank(1, f.kv_heads, m, d), _blank(1, f.kv_heads, m, d))
    bounds = (_ints([0]), _ints([m]), _ints([0]))
    sinks = _blank(f.heads, dtype=torch.float32) if f.sinks else None
    for window in (0, f.window) if f.window else (0,):
        add(f"attention prefill {f.heads}/{f.kv_heads}x{d}" + (f", window {window}" if window else ""), "attention",
            attention_prefill_cost(m, f.heads, f.kv_heads, d, window),
            attention, *qkv, *bounds, d ** -0.5, window=window, sinks=sinks)
    gemm("o_proj", h, f.heads * d, row_parallel=True)
    norm("post_attention_layernorm", m, h)
    if f.experts:
        gemm("router", f.experts, h)
        rows, width = m * f.top_k, f.intermediate
        # balanced routing: rows spread over the experts in order (the grid does not depend on it)
        offsets = torch.tensor([rows * e // f.experts for e in range(f.experts + 1)], dtype=torch.int32)
        add(f"experts gate_up {f.experts}x{2 * width}x{h}", "gemm", grouped_gemm_cost(rows, 2 * width, h, f.experts),
            grouped_linear, _blank(rows, h), _blank(f.experts, 2 * width, h), offsets)
        add(f"experts clamped_swiglu {width}", "elementwise", elementwise_cost(rows, width),
            clamped_swiglu, _blank(rows, width), _blank(rows, width), 1.702, 7.0)
        add(f"experts down {f.experts}x{h}x{width}", "gemm", grouped_gemm_cost(rows, h, width, f.experts),
            grouped_linear, _blank(rows, width), _blank(f.experts, h, width), offsets)
    else:
        gemm("gate_proj", f.intermediate, h)
        gemm("up_proj", f.intermediate, h)
        n, k = h, f.intermediate
        config = row_parallel_config("cpu", DTYPE, n, k)
        if f.gelu:
            add(f"gelu_tanh_mul {k}", "elementwise", elementwise_cost(m, k), gelu_tanh_mul, _blank(m, k), _blank(m, k))
            gemm("down_proj", n, k, row_parallel=True)
        else:
            add(f"down_proj (silu_mul_linear) {n}x{k}", "gemm", gemm_cost(m, n, k, inputs=2),
                silu_mul_linear, _blank(m, k), _blank(m, k), _blank(n, k), config=config)
    if f.gdn:
        hk, hv, dk, dv = f.gdn
        gemm("in_proj_qkv", 2 * hk * dk + hv * dv, h)
        gemm("in_proj_z", hv * dv, h)
        gemm("in_proj_b (and in_proj_a)", hv, h)
        fp32 = torch.float32
        add(f"gated_delta_rule {hk}/{hv} heads {dk}x{dv}", "gdn", gated_delta_rule_cost(m, hk, hv, dk, dv),
            chunk_gated_delta_rule, _blank(m, hk, dk), _blank(m, hk, dk), _blank(m, hv, dv), _blank(m, hv),
            _blank(m, hv), _blank(hv, dtype=fp32), _blank(hv, dtype=fp32), _ints([0]), _ints([m]),
            _blank(1, hv, dk, dv, dtype=fp32))
        gemm("out_proj", h, hv * dv, row_parallel=True)
    gemm("lm_head", f.vocab, h)
    add(f"rms_norm backward (d x, d weight) {h}", "norm", rms_norm_backward_cost(m, h),
        rms_norm_backward, _blank(m, h), _blank(h), 1e-6, _blank(m, h))
    return calls


def decode_calls(family: Family, batch: int, context: int = DECODE_CONTEXT):
    """(kernel row, kind, cost, call): one decode step's attention for ``batch`` sequences of ``context``
    tokens, on the padded path (``attention``: the model's cache) and the paged one (the engine's)."""
    from invariant_infer.kernels import attention, attention_config, paged_attention

    f = family
    d = f.head_dim
    calls = []
    q, kv = _blank(batch, f.heads, 1, d), _blank(batch, f.kv_heads, context, d)
    sinks = _blank(f.heads, dtype=torch.float32) if f.sinks else None
    bounds = (_ints([0] * batch), _ints([context] * batch), _ints([context - 1] * batch))
    windows = (0, f.window) if f.window else (0,)
    for window in windows:
        suffix = f", window {window}" if window else ""
        cost = attention_decode_cost(batch, context, f.heads, f.kv_heads, d, window)
        calls.append((f"attention decode{suffix}", "decode", cost,
                      partial(attention, q, kv, kv, *bounds, d ** -0.5, window=window, sinks=sinks)))

        def paged(window=window):
            page = attention_config("cpu", DTYPE, d).block_n  # the engine's page: the kernel's KV block
            pages = -(-context // page)
            k_cache = _blank(batch * pages, page, f.kv_heads, d)
            tables = torch.arange(batch * pages, dtype=torch.int32).reshape(batch, pages)
            return paged_attention(_blank(batch, f.heads, d), k_cache, k_cache, _ints(list(range(batch + 1))),
                                   _ints([context] * batch), tables, d ** -0.5, max_query_len=1, window=window,
                                   sinks=sinks, max_seq_len=context)  # as the engine passes it (a host value)
        calls.append((f"paged attention decode{suffix}", "decode", cost, paged))
    return calls


def record_rows(name: str, family: Family, m_values=M_VALUES, sm_count: int = 132) -> list[Row]:
    """Every row of ``name``: each call recorded with the CUDA tiles of a GPU of ``sm_count`` SMs."""
    from invariant_infer.kernels.configs import TileTarget
    from invariant_infer.kernels.launch_recording import recorded_launches

    rows = []
    with recorded_launches(TileTarget("cuda", sm_count), zeroed_allocations=False) as recorder, torch.no_grad():
        plans = [(str(m), call) for m in m_values for call in layer_calls(family, m)]
        plans += [(f"B={batch} L={DECODE_CONTEXT}", call)
                  for batch in DECODE_BATCHES for call in decode_calls(family, batch)]
        for m, (kernel, kind, cost, run) in plans:
            first = len(recorder.launches)
            run()
            launches = recorder.launches[first:]
            grids = [(launch.variant.name, launch.grid) for launch in launches]
            tiled = [launch for launch in launches if "BLOCK_K" in _constexprs(launch)]
            tile = _tile(max(tiled, key=lambda launch: launch.programs)) if tiled and kind == "gemm" else ""
            rows.append(Row(name, kernel, kind, m, cost, grids, tile))
    return rows


def _constexprs(launch) -> dict:
    names = [name for name, _ in launch.variant.signature]
    return {names[path[0]]: value for path, value in launch.variant.constexprs if len(path) == 1}


def _tile(launch) -> str:
    """'BLOCK_M x BLOCK_N x BLOCK_K wW sS' of a recorded GEMM launch, from its constexprs and options."""
    consts = _constexprs(launch)
    options = dict(launch.variant.options)
    blocks = "x".join(str(consts[key]) for key in ("BLOCK_M", "BLOCK_N", "BLOCK_K") if key in consts)
    return f"{blocks} w{options.get('num_warps', '?')} s{options.get('num_stages', '?')}"


def text_report(rows: list[Row], gpus: list[Gpu]) -> str:
    """Every row: kernel, M, programs per launch, waves, a GEMM's tile, MB, GFLOP, bound per GPU."""
    head = ("| family | kernel | M | programs | waves | tile | MB | GFLOP | "
            + " | ".join(f"{g.name} µs" for g in gpus) + " |")
    lines = [head, "|" + "---|" * (8 + len(gpus))]
    for row in rows:
        lines.append(f"| {row.family} | {row.kernel} | {row.m} | {row.programs_text()} | {row.waves(gpus[0]):.2f} | "
                     f"{row.tile} | "
                     f"{row.cost.bytes / 1e6:.2f} | {row.cost.flops / 1e9:.3f} | "
                     + " | ".join(f"{row.bound_us(g):.1f}" for g in gpus) + " |")
    return "\n".join(lines)


def _cell(row: Row, gpus: list[Gpu]) -> str:
    bounds = " / ".join(f"{row.bound_us(g):.1f}" for g in gpus)
    return f"{row.programs_text()} ({row.waves(gpus[0]):.2f}) · {bounds}"


def doc_tables(rows: list[Row], gpus: list[Gpu]) -> str:
    """One table per family: a row per kernel, a column per M (and per decode batch); each cell
    'programs per launch (waves) · bound µs' with the bound per GPU, in the order given."""
    lines = [f"`python -m benchmarks plan --write-doc`. Each cell: programs per launch (waves on "
             f"{gpus[0].sms} SMs) · roofline bound in µs on {' / '.join(g.name for g in gpus)}. bf16.", ""]
    for family in dict.fromkeys(row.family for row in rows):
        mine = [row for row in rows if row.family == family]
        columns = list(dict.fromkeys(row.m for row in mine))
        kernels = list(dict.fromkeys(row.kernel for row in mine))
        cells = {(row.kernel, row.m): row for row in mine}
        titles = [f"M={c}" if c.isdigit() else c for c in columns]
        lines += [f"**{family}**", "", "| kernel | " + " | ".join(titles) + " |", "|---|" + "---|" * len(columns)]
        for kernel in kernels:
            lines.append(f"| {kernel} | " + " | ".join(_cell(cells[(kernel, c)], gpus) if (kernel, c) in cells else ""
                                                       for c in columns) + " |")
        lines.append("")
    return "\n".join(lines)


def below_one_wave(rows: list[Row], gpu: Gpu) -> list[Row]:
    """The GEMM rows at M <= 64 and decode rows at batch 1 whose largest launch fills less than one wave."""
    return [row for row in rows if row.wants_a_wave() and row.programs() < gpu.sms]


def write_doc(text: str, doc: Path | None = None) -> None:
    replace_section(text, BEGIN, END, doc or DOC)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu", choices=sorted(GPUS), help="one GPU (default: both)")
    parser.add_argument("--families", help=f"comma-separated, of: {', '.join(FAMILIES)} (default: all)")
    parser.add_argument("--m", default=",".join(map(str, M_VALUES)), help="comma-separated token counts")
    parser.add_argument("--write-doc", action="store_true", help=f"replace the plan tables in {DOC.name}")
    args = parser.parse_args(argv)
    gpus = [GPUS[args.gpu]] if args.gpu else list(GPUS.values())
    names = args.families.split(",") if args.families else list(FAMILIES)
    unknown = [name for name in names if name not in FAMILIES]
    if unknown:
        parser.error(f"unknown families {unknown}; choose from {', '.join(FAMILIES)}")
    m_values = tuple(int(m) for m in args.m.split(","))
    rows = []
    for sms in sorted({gpu.sms for gpu in gpus}):  # programs depend on the SM count only
        for name in names:
            rows += record_rows(name, FAMILIES[name], m_values, sms)
    print(text_report(rows, gpus))
    for gpu in gpus:
        missing = below_one_wave(rows, gpu)
        print(f"\n{gpu.name}: {len(missing)} GEMM rows at M <= 64 and decode rows at batch 1 below one wave "
              f"({gpu.sms} programs):")
        for row in missing:
            print(f"  {row.family} {row.kernel} M={row.m}: {row.programs_text()} programs")
    if args.write_doc:
        write_doc(doc_tables(rows, gpus))
    return 0


if __name__ == "__main__":
    sys.exit(main())
