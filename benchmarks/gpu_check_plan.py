"""What the GPU check runs, in priority order, and each section's time slice.

    smoke               imports, pinned compile options, one linear and one attention launch (row alone == in batch)
    gpu_tests           every ``gpu``-marked test in the files this machine can import (gpu_check_tests)
    check               ``invariant-infer check`` on a random checkpoint of Qwen2.5-1.5B (dry run: qwen2 tiny)
    golden_digests      this backend's golden digests, family by family (into golden_digests.json)
    ratios_matmul       headline ratios: GEMM at M = 1, 16, 64, 4096 on the preset's projections, against cuBLAS
    ratios_attention    attention prefill (against SDPA as transformers calls it, its flash backend and
                        FlashAttention) and split-KV decode at 8K context, batch 1 and 16 (``attention`` and
                        ``paged_attention`` against FlashInfer, FlashAttention and SDPA)
    ratios_quant        FP8 GEMMs (per channel, 128x128 blocks) against torch._scaled_mm, M = 1, 16, 64, 4096
    ratios_e2e          end-to-end scoring and decode
    ratios_engine       serving-engine throughput at concurrency 1 and 32
    tensor_parallel     TP 1, 2, 4, 8 as the GPUs allow, bitwise against TP 1 (skipped below two GPUs)
    rest_<section>      the other items of every benchmark section, one process each
    preset_<name>       the matmul section's headline Ms at other families' shapes (Qwen3-8B, Llama-3.1-8B)

The dry run (CPU, Triton interpreter) runs every kind of section at tiny shapes: smoke, gpu_tests
(selection and collection for real; the tests skip without CUDA), check on qwen2 tiny, the golden
digests of qwen2 in bf16 (compared with the committed CPU entry), the five ratio sections with
``--quick``, tensor_parallel (skipped), rest_matmul and the Qwen3-8B preset.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from . import SECTIONS
from .gpu_check_runner import Section

# The kernels against the fastest stock ones first (each cheap: a few seconds of GPU time per item),
# then end to end. A stock kernel whose library is missing is a skipped row, not a failed section.
RATIOS = (("ratios_matmul", "matmul"), ("ratios_attention", "norm_attention"), ("ratios_quant", "quant"),
          ("ratios_e2e", "e2e"), ("ratios_engine", "engine"))
REST = tuple(s for s in SECTIONS if s != "tensor_parallel")
DRY_RUN_REST = ("matmul",)
DEFAULT_EXTRA_PRESETS, DRY_RUN_EXTRA_PRESETS = "qwen3:qwen3-8b llama:llama-3.1-8b", "qwen3:qwen3-8b"
# Most seconds per section on a GPU (the slice is also cut to what is left of TOTAL_S), and the
# least worth starting. A benchmark section stops starting items BENCH_MARGIN_S before its slice ends.
# The first four leave about half of the default TOTAL_S to the headline ratios.
SLICES = {"smoke": 60, "gpu_tests": 120, "check": 60, "golden_digests": 60, "ratios_matmul": 75,
          "ratios_attention": 60, "ratios_quant": 60, "ratios_e2e": 90, "ratios_engine": 75, "tensor_parallel": 150,
          "rest": 60, "rest_divergence": 90, "rest_embed": 150, "preset": 90}
DRY_RUN_SLICES = {"smoke": 60, "gpu_tests": 150, "check": 60, "golden_digests": 60, "rest": 60, "preset": 60,
                  "tensor_parallel": 60}
MIN_S = {"smoke": 15, "gpu_tests": 30, "check": 30, "golden_digests": 30, "tensor_parallel": 30}
BENCH_MIN_S, BENCH_MARGIN_S, QUICK_MARGIN_S = 30, 30, 15


def gpu_count() -> int:
    """GPUs nvidia-smi lists (0 without it): no CUDA initialised in the runner."""
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(line.startswith("GPU ") for line in out.splitlines())


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _test_counts(run_json: Path):
    def fields() -> dict:
        run = _read_json(run_json)
        return {"counts": run.get("counts", {}), "running": run.get("running")} if run else {}
    return fields


def _golden_fields(out: Path):
    def fields() -> dict:
        entries = _read_json(out)
        entry = next(iter(entries.values()), {}) if entries else {}
        return {"digests": len(entry.get("digests", {})), "part_errors": entry.get("errors", {})} if entry else {}
    return fields


def _slice(name: str, dry_run: bool, overrides: dict) -> float:
    table = DRY_RUN_SLICES if dry_run else SLICES
    kind = name.split("_")[0] if name.startswith(("rest_", "preset_", "ratios_")) else name
    default = table.get(name, table.get(kind, table.get("rest", 60)))
    return float(overrides.get(name, default))


def plan(dest: Path, details: Path, dry_run: bool, extra_presets: str = DEFAULT_EXTRA_PRESETS,
         slices: dict | None = None, gpus: int | None = None) -> list[Section]:
    """The sections in priority order. ``slices``: {section name: seconds} overriding the defaults;
    ``gpus``: the GPU count (default: nvidia-smi's)."""
    py, device = sys.executable, "cpu" if dry_run else "cuda"
    overrides = slices or {}
    quick = ["--quick"] if dry_run else []
    margin = QUICK_MARGIN_S if dry_run else BENCH_MARGIN_S

    def section(name: str, argv: list, **kw) -> Section:
        return Section(name, argv, _slice(name, dry_run, overrides), MIN_S.get(name, BENCH_MIN_S), **kw)

    def bench(name: str, bench_section: str, items: str, *extra, **kw) -> Section:
        slice_s = _slice(name, dry_run, overrides)
        return section(name, [py, "-m", "benchmarks.gpu_check_bench", bench_section, "--out", details / name,
                              "--budget-s", f"{max(5.0, slice_s - margin):.0f}", "--margin-s", f"{margin}",
                              "--items", items, *quick, *extra],
                       **kw)

    golden_out = dest / "golden_digests.json"
    subset = ["--families", "qwen2", "--dtypes", "bf16"] if dry_run else []
    sections = [
        section("smoke", [py, "-m", "benchmarks.gpu_check_smoke", "--device", device]),
        section("gpu_tests", [py, "-m", "benchmarks.gpu_check_tests", "--out", details / "gpu_tests"],
                fields=_test_counts(details / "gpu_tests" / "run.json")),
        section("check", [py, "-m", "benchmarks.gpu_check_model_check", "--device", device]),
        section("golden_digests", [py, "-m", "benchmarks.golden_digests", "--device", device, "--new-backend-ok",
                                   "--out", golden_out, *subset], fields=_golden_fields(golden_out)),
        *(bench(name, bench_section, "headline") for name, bench_section in RATIOS),
    ]
    count = gpu_count() if gpus is None else gpus
    sections.append(bench("tensor_parallel", "tensor_parallel", "all", precondition=lambda: (
        f"tensor parallelism needs two or more GPUs (found {count})" if count < 2 else None)))
    sections += [bench(f"rest_{name}", name, "rest") for name in (DRY_RUN_REST if dry_run else REST)]
    for preset in extra_presets.split():
        # the headline Ms (1, 16, 64, 4096) on every projection: the whole set fits the slice
        sections.append(bench(f"preset_{preset.partition(':')[2]}", "matmul", "headline", "--model-preset", preset))
    return sections
