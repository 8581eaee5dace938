"""The offline compile gate: every kernel variant the supported families reach compiles for sm_80,
sm_89 and sm_90 within each architecture's shared memory, with the tiles a GPU uses (fp8 variants
for sm_89 and sm_90 only: their launchers refuse older GPUs by name).

The variants are recorded, not listed: ``invariant_infer.testing.kernel_variants`` runs each
workload (forward, backward, engine, LoRA, every quantized format) at real widths under
``recorded_launches``, and each distinct variant is compiled for each architecture (sm_89 reads
sm_80's compile where the two lower to the same IR: every variant without fp8). A kernel path a
workload reaches cannot escape the gate; a compile error or a block's shared memory over the
architecture's limit fails it. Runs on CPU: Triton compiles to cubin without a GPU."""
import re

import pytest
import torch

from invariant_infer.kernels import (QuantizedWeight, attention, fp8_support, linear, quantize_activations,
                                     quantized_linear, rms_norm)
from invariant_infer.kernels.configs import tile_device, tile_target
from invariant_infer.kernels.errors import UnsupportedOperationError
from invariant_infer.kernels.fp8_support import fp8_supported
from invariant_infer.kernels.launch_recording import recorded_launches
from invariant_infer.kernels.offline_compile import (ARCHS, SAME_IR_AS, SHARED_MEMORY_LIMITS, CompileReport, as_arch,
                                                     compile_report, compile_variant)

pytestmark = pytest.mark.file_minutes(3.0)  # the heavy gate: about 220 CPU-seconds


def _fp8_block_weight(n=256, k=256):
    data = torch.randn(n, k).clamp(-4, 4).to(torch.float8_e4m3fn)
    return QuantizedWeight("fp8", data, torch.rand(n // 128, k // 128) + 0.5, (n, k), block=True)


def test_fp8_block_kernel_compiles_for_sm90():
    """The FP8_BLOCK GEMM (fp8 activations in 128-wide groups, 128 x 128 weight blocks) as its
    launch records it: it once read a plain module global inside @triton.jit, which the interpreter
    allows and compiled Triton refuses (NameError)."""
    q, scale = quantize_activations(torch.randn(3, 256, dtype=torch.bfloat16), torch.float8_e4m3fn, group_size=128)
    with recorded_launches() as recorder:
        quantized_linear(q, _fp8_block_weight(), x_scale=scale, out_dtype=torch.bfloat16, parallel_chunks=False)
    (variant,) = recorder.variants
    assert variant.name == "_quantized_linear_kernel" and ("GROUPED=True" in variant.label())
    report = compile_report(variant, 90)
    assert report.problem is None, report.problem
    assert 0 < report.shared <= SHARED_MEMORY_LIMITS[90] and report.registers


def test_recording_takes_gpu_tiles_and_runs_nothing():
    """Recorded launches take the CUDA tiles on CPU tensors and leave outputs unwritten; outside
    the context every launch runs again with the interpreter's tiles (the tile lookup is restored)."""
    x = torch.randn(4, 1536, dtype=torch.bfloat16)
    w = torch.randn(1536, dtype=torch.bfloat16)
    with recorded_launches() as recorder:
        assert tile_device("cpu") == "cuda" and tile_device("cuda") == "cuda"
        out = rms_norm(x, w, 1e-6)
        linear(x, torch.randn(256, 1536, dtype=torch.bfloat16))
    assert tile_device("cpu") == "cpu" and tile_target() is None
    labels = sorted(variant.label() for variant in recorder.variants)
    # Qwen2.5-1.5B's k/v shape: its GPU rule config (K cut in 12 chunks), run as parallel chunks at small M
    assert any(label.startswith("_linear_kernel(") and "K_CHUNKS=12" in label and "BLOCK_N=16" in label
               and "PARALLEL_CHUNKS=True" in label for label in labels), labels
    assert any(label.startswith("_chunk_combine_kernel(") for label in labels), labels
    assert any(label.startswith("_rms_norm_kernel(") and "BLOCK_ROWS=1," in label for label in labels), labels
    assert not torch.equal(out, rms_norm(x, w, 1e-6))  # control: the recorded call ran nothing
    with recorded_launches() as recorder:
        pass
    assert not recorder.variants


def test_a_batch_size_is_not_a_variant():
    """M is do_not_specialize: 1, 16 and 37 rows record one variant per kernel (Triton would
    otherwise compile one for M = 1 and one for M divisible by 16)."""
    w = torch.randn(1536, dtype=torch.bfloat16)
    with recorded_launches() as recorder:
        for rows in (1, 16, 37):
            rms_norm(torch.randn(rows, 1536, dtype=torch.bfloat16), w, 1e-6)
    assert len(recorder.variants) == 1 and list(recorder.variants.values()) == [3]


def test_gate_fails_on_shared_memory_over_the_limit():
    """The gate's other failure: a variant that compiles but needs more shared memory than a block
    of that architecture may use (an sm_90-sized report checked against sm_89's 99 KiB)."""
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    with recorded_launches() as recorder:
        rms_norm(x, torch.randn(256, dtype=torch.bfloat16), 1e-6)
    (variant,) = recorder.variants
    over = CompileReport(variant, 89, shared=SHARED_MEMORY_LIMITS[89] + 1, registers=32)
    assert "shared memory" in over.problem
    assert CompileReport(variant, 89, shared=SHARED_MEMORY_LIMITS[89], registers=32).problem is None


# Findings of the gate (docs/benchmarks.md, "Compiled kernels"): name -> a predicate on a
# CompileReport, each naming a class of variants that a GPU of that architecture cannot launch
# today (none now). Any other problem fails the gate, and so does an entry that no longer occurs
# (remove it once fixed).
KNOWN_PROBLEMS: dict = {}

# Triton has no float8_e4m3fn before sm_89 (no fp8 MMA): the fp8 launchers refuse those GPUs by name
# (kernels.fp8_support), so the gate compiles fp8 variants only where they launch.
FP8_ARCHS = tuple(arch for arch in ARCHS if fp8_supported(divmod(arch, 10)))


def _is_fp8(variant):
    return any(kind == "*fp8e4nv" for _, kind in variant.signature)


def test_the_gate_skips_fp8_exactly_where_the_launchers_refuse(monkeypatch):
    """An arch the gate compiles no fp8 variant for is one whose GPUs the fp8 launcher refuses (its
    real check, the capability faked), and only those: skipping hides no compile error."""
    x = torch.randn(2, 128, dtype=torch.bfloat16)
    refused = set()
    for arch in ARCHS:
        monkeypatch.setattr(fp8_support, "device_capability", lambda device, arch=arch: divmod(arch, 10))
        try:
            quantize_activations(x, torch.float8_e4m3fn)
        except UnsupportedOperationError:
            refused.add(arch)
    assert refused == set(ARCHS) - set(FP8_ARCHS) and 80 in refused


# Kernels the workloads must reach: a workload that silently stopped recording (an unpatched path)
# fails here rather than passing the gate with nothing to compile.
EXPECTED_KERNELS = {
    "_linear_kernel", "_chunk_combine_kernel", "_rms_norm_kernel", "_silu_mul_kernel", "_attention_kernel",
    "_paged_attention_kernel", "_split_kv_combine_kernel", "_token_logprobs_kernel", "_token_logprobs_backward_kernel",
    "_attention_bwd_dq_kernel", "_attention_bwd_dkdv_kernel", "_attention_bwd_delta_kernel",
    "_rms_norm_backward_kernel",
    "_chunk_gated_delta_rule_kernel", "_causal_conv1d_silu_kernel", "_rms_norm_gated_kernel", "_sigmoid_mul_kernel",
    "_grouped_linear_kernel", "_moe_routing_kernel", "_moe_group_routing_kernel", "_clamped_swiglu_kernel",
    "_quantized_linear_kernel",
    "_quantized_partials_kernel", "_quantized_combine_kernel", "_grouped_quantized_linear_kernel",
    "_quantize_rows_kernel", "_gelu_kernel",
    "_gelu_tanh_mul_kernel", "_gelu_tanh_mul_backward_kernel", "_layer_norm_kernel", "_silu_mul_backward_kernel",
    "_pool_tokens_kernel", "_l2_normalize_kernel", "_tanh_kernel",
}


@pytest.mark.heavy
def test_every_variant_the_families_reach_compiles_for_every_arch():
    """Record every workload (about 25 s), compile each of the ~140 distinct variants for sm_80 and
    sm_90, and the fp8 ones for FP8_ARCHS, in two processes (about 190 CPU-seconds); the sm_80 report
    of a variant without fp8 stands for sm_89 (``SAME_IR_AS``: the same IR, its shared memory checked
    against sm_89's limit). No problem but the known ones."""
    from invariant_infer.kernels.offline_compile import compile_reports
    from invariant_infer.testing.kernel_variants import record_variants

    variants = record_variants()
    missing = EXPECTED_KERNELS - {variant.name for variant in variants}
    assert not missing, f"no workload launches {sorted(missing)}"
    labels = [variant.label() for variant in variants]
    assert any("HAS_SINKS=True" in label for label in labels)  # gpt-oss's sinks
    assert {_formats(variant) for variant in variants} >= {(0, False), (0, True), (1, False), (2, False), (2, True)}
    fp8 = [variant for variant in variants if _is_fp8(variant)]
    assert fp8, "no workload launches an fp8 kernel"
    compiled_archs = tuple(arch for arch in ARCHS if arch not in SAME_IR_AS)
    reports = compile_reports([variant for variant in variants if not _is_fp8(variant)], compiled_archs, workers=2)
    reports += [as_arch(report, arch) for arch, source in SAME_IR_AS.items() for report in reports
                if report.arch == source]
    reports += compile_reports(fp8, FP8_ARCHS, workers=2)
    assert {report.arch for report in reports} == set(ARCHS)
    problems = [report for report in reports if report.problem]
    unknown = [report.problem for report in problems if not any(match(report) for match in KNOWN_PROBLEMS.values())]
    assert not unknown, "\n".join(unknown)
    stale = [name for name, match in KNOWN_PROBLEMS.items() if not any(match(report) for report in problems)]
    assert not stale, f"known problems that no longer occur (remove them): {stale}"


def _ir(compiled) -> str:
    return re.sub(r'"cuda:\d+"', '"cuda"', compiled.asm["ttgir"])


@pytest.mark.heavy
def test_sm89_lowers_a_kernel_without_fp8_to_the_ir_of_sm80():
    """What lets the gate read sm_80's reports for sm_89: a dot-heavy GEMM, attention (its dots and
    online softmax) and a row reduction lower to the same Triton IR for both, with the same shared
    memory; an fp8 GEMM does not (the control: sm_89 converts fp8 natively)."""
    x = torch.randn(4, 1536, dtype=torch.bfloat16)
    q, k = torch.randn(1, 2, 16, 128, dtype=torch.bfloat16), torch.randn(1, 1, 16, 128, dtype=torch.bfloat16)
    lengths = torch.tensor([16], dtype=torch.int32)
    with recorded_launches() as recorder:
        linear(x, torch.randn(256, 1536, dtype=torch.bfloat16))
        attention(q, k, k, torch.zeros_like(lengths), lengths, torch.zeros_like(lengths), 0.1)
        rms_norm(x, torch.randn(1536, dtype=torch.bfloat16), 1e-6)
    names = {variant.name for variant in recorder.variants}
    assert {"_linear_kernel", "_attention_kernel", "_rms_norm_kernel"} <= names, names
    for variant in recorder.variants:
        sm80, sm89 = compile_variant(variant, 80), compile_variant(variant, 89)
        assert _ir(sm80) == _ir(sm89) and sm80.metadata.shared == sm89.metadata.shared, variant.label()
    q8, scale = quantize_activations(torch.randn(3, 256, dtype=torch.bfloat16), torch.float8_e4m3fn, group_size=128)
    with recorded_launches() as recorder:
        quantized_linear(q8, _fp8_block_weight(), x_scale=scale, out_dtype=torch.bfloat16, parallel_chunks=False)
    (fp8_variant,) = recorder.variants
    assert _ir(compile_variant(fp8_variant, 89)) != _ir(compile_variant(fp8_variant, 90))
    with pytest.raises(ValueError, match="does not stand for"):
        as_arch(CompileReport(fp8_variant, 90, shared=0), 89)


def _formats(variant):
    """(FORMAT, HAS_ZP) of a quantized GEMM variant; fp8 per channel and block differ in GROUPED."""
    names = [parameter for parameter, _ in variant.signature]
    values = {names[path[0]]: value for path, value in variant.constexprs}
    if variant.name != "_quantized_linear_kernel":
        return None
    return (values["FORMAT"], values["HAS_ZP"] if values["FORMAT"] == 2 else values["GROUPED"])
