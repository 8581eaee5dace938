"""The compile options the launches pin reach the compiled code, alignment reaches only row
reductions, and the CUDA configs of the dtypes the gate does not record (fp16, fp32) compile for
sm_80, sm_89 and sm_90.

Runs on CPU: Triton compiles to PTX and cubin without a GPU. Every bf16 variant the supported
families reach (forward, backward, engine, LoRA, quantized formats) is compiled by the offline
compile gate, tests/kernels/test_compile_gate.py, from the launches it records; the cases here are
hand-specified. It checks compilation, not speed or results; the gpu-marked tests check those on a
GPU. A compile that raises fails its test: nothing is skipped."""
import inspect
import re
import sys

import pytest
import torch

import invariant_infer.kernels  # noqa: F401  (loads the kernel modules)
from helpers.kernel_compile import compile_for, reduction_layouts
from invariant_infer.kernels import attention_config, linear_config

configs_mod = sys.modules["invariant_infer.kernels.configs"]
launch_mod = sys.modules["invariant_infer.kernels.launch"]
linear_mod = sys.modules["invariant_infer.kernels.linear"]
attention_mod = sys.modules["invariant_infer.kernels.attention"]
paged_mod = sys.modules["invariant_infer.kernels.paged_attention"]
rms_mod = sys.modules["invariant_infer.kernels.rms_norm"]
silu_mod = sys.modules["invariant_infer.kernels.silu_mul"]
logprobs_mod = sys.modules["invariant_infer.kernels.token_logprobs"]
gdn_mod = sys.modules["invariant_infer.kernels.gated_delta_rule"]
conv_mod = sys.modules["invariant_infer.kernels.causal_conv1d"]
gated_norm_mod = sys.modules["invariant_infer.kernels.rms_norm_gated"]
sigmoid_mod = sys.modules["invariant_infer.kernels.sigmoid_mul"]
exact_gelu_mod = sys.modules["invariant_infer.kernels.gelu"]
quantized_mod = sys.modules["invariant_infer.kernels.quantized_linear"]

TL_DTYPE = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
# bf16, the dtype checkpoints run in, is the gate's (recorded at real widths, every arch).
OTHER_DTYPES = [torch.float16, torch.float32]
ARCHS = [90, 89, 80]
DOT_PRECISION = launch_mod.DOT_PRECISION
FMA = re.compile(r"\b(fma|mad)\.rn(\.ftz)?\.f32\b")


def _rms_norm(arch=90, dtype=torch.bfloat16, hidden=1536, options=None):
    block_rows, block_n, warps = rms_mod._launch_params(torch.device("cuda"), hidden)
    return compile_for(rms_mod._rms_norm_kernel, arch, {"ptr": f"*{TL_DTYPE[dtype]}", "eps": "fp32"},
                       dict(BLOCK_ROWS=block_rows, BLOCK_N=block_n), warps, options=options)


def test_offline_cuda_compiler_present():
    """Triton's CUDA backend and its bundled ptxas: without them every test below fails, by design."""
    from triton import knobs
    from triton.backends import backends
    assert "nvidia" in backends, "this triton build has no CUDA backend"
    assert knobs.nvidia.ptxas.path, "triton cannot find ptxas"


def test_pinned_options_reach_the_compiled_kernel():
    meta = _rms_norm().metadata
    for name, value in launch_mod.PINNED_OPTIONS.items():
        assert getattr(meta, name) == value, name


def test_fp_fusion_stays_pinned_when_the_default_moves(monkeypatch):
    """RMSNorm has mul + add pairs that Triton contracts into FMAs when fusion is on. With the
    default turned off (as TRITON_DEFAULT_FP_FUSION=0 does, and Triton 3.10), the default options
    leave none: the control. The pinned options keep them."""
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "0")
    assert not FMA.search(_rms_norm(options={}).asm["ptx"]), "control: the default no longer moves; cannot fail"
    assert FMA.search(_rms_norm().asm["ptx"])


def test_launches_refuse_when_the_pins_cannot_hold(monkeypatch):
    """Eager launches pass the pins; under torch.compile inductor compiles with Triton's defaults, so
    a default that differs from a pin is refused, as is a variable that overrides an explicit pin."""
    assert launch_mod.pinning_problem(traced=False) is None and launch_mod.pinning_problem(traced=True) is None
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "0")
    assert launch_mod.pinning_problem(traced=False) is None
    assert "TRITON_DEFAULT_FP_FUSION=1" in launch_mod.pinning_problem(traced=True)
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    monkeypatch.setenv("PTXAS_OPTIONS", "--fmad=false")
    assert "PTXAS_OPTIONS" in launch_mod.pinning_problem(traced=True)
    monkeypatch.setenv("PTXAS_OPTIONS", "-v")
    assert launch_mod.pinning_problem(traced=True) is None
    monkeypatch.setenv("TRITON_FORCE_DISABLE_FP_FUSION", "1")
    assert "TRITON_FORCE_DISABLE_FP_FUSION" in launch_mod.pinning_problem(traced=False)


def test_launch_passes_pinned_options_to_cuda_launches():
    """The launcher adds the pinned options to every compiled launch (checked without a GPU)."""
    seen = {}

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: seen.update(grid=grid, args=args, kwargs=kwargs)

    launch_mod.launch(Kernel(), (3,), torch.device("cuda"), 1, 2, BLOCK=16, num_warps=4)
    assert seen["grid"] == (3,) and seen["args"] == (1, 2)
    assert seen["kwargs"] == {"BLOCK": 16, "num_warps": 4, **launch_mod.PINNED_OPTIONS}


def test_a_variable_set_after_import_is_refused_at_the_next_launch(monkeypatch):
    """Triton reads its knobs at every compile, so the check runs at every eager launch, not once."""
    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: None

    launch_mod.launch(Kernel(), (1,), torch.device("cuda"), 1)
    monkeypatch.setenv("TRITON_FORCE_DISABLE_FP_FUSION", "1")
    with pytest.raises(RuntimeError, match="TRITON_FORCE_DISABLE_FP_FUSION"):
        launch_mod.launch(Kernel(), (1,), torch.device("cuda"), 1)


_WORKSPACE = {"m_ws_ptr": "*fp32", "l_ws_ptr": "*fp32", "acc_ws_ptr": "*fp32"}  # split-KV chunk states


def _alignment_cases():
    bf16 = {"ptr": "*bf16"}
    yield "linear", linear_mod._linear_kernel, bf16, dict(
        HAS_BIAS=True, K_CHUNKS=2, PARALLEL_CHUNKS=False, PROLOGUE=linear_mod.PROLOGUE_SILU_MUL, BLOCK_M=64,
        BLOCK_N=128, BLOCK_K=64, GROUP_M=8, DOT_PRECISION=DOT_PRECISION), 4, 3
    yield "attention", attention_mod._attention_kernel, {
        **bf16, "kv_start_ptr": "*i32", "kv_end_ptr": "*i32", "q_start_ptr": "*i32", "scale": "fp32",
        **_WORKSPACE}, dict(
        GROUP=2, BLOCK_M=64, BLOCK_N=64, BLOCK_D=64, KV_CHUNK=512, DOT_PRECISION=DOT_PRECISION, STORE_LSE=False), 4, 2
    yield "rms_norm", rms_mod._rms_norm_kernel, {**bf16, "eps": "fp32"}, dict(BLOCK_ROWS=1, BLOCK_N=2048), 4, 3


@pytest.mark.parametrize("name, kernel, types, constexprs, warps, stages",
                         [pytest.param(*case, id=case[0]) for case in _alignment_cases()])
def test_alignment_reaches_the_arithmetic_of_row_reductions_only(name, kernel, types, constexprs, warps, stages):
    """Aligned pointers and row strides divisible by 16 (the variant Triton compiles for most
    calls) against none: the same dot and reduction layouts for the dot kernels, whose operands
    are re-laid out for the MMA; another reduction layout for RMSNorm, whose loads set its
    summation tree. That is why the row kernels take ``reduction_rows``."""
    params = inspect.signature(kernel.fn).parameters
    aligned = [p for p in params if p.endswith("_ptr") or re.fullmatch(r"stride_\w*[^dkn]", p)]
    layouts = [reduction_layouts(compile_for(kernel, 90, types, constexprs, warps, stages, aligned=a))
               for a in (aligned, [])]
    assert (layouts[0] == layouts[1]) == (name != "rms_norm"), layouts


@pytest.mark.parametrize("make_view, copied", [
    (lambda t: t[:, :48], True),                                  # row stride 64, width 48
    (lambda t: t[2:3, :32], True),                                # one row of another row stride
    (lambda t: t.reshape(-1)[3:3 + 7 * 64].view(7, 64), True),    # a start 12 bytes in
    (lambda t: t[1:], False),                                     # a start 256 bytes in: aligned, kept
    (lambda t: t, False),
], ids=["row-stride", "one-row", "offset-unaligned", "offset-aligned", "contiguous"])
def test_reduction_rows_depend_on_width_alone(make_view, copied):
    """Row kernels get rows N elements apart from a 16-byte-aligned start, so the compiled
    variant (the load width, hence the summation tree) never follows how a batch was sliced."""
    view = make_view(torch.arange(8 * 64, dtype=torch.float32).reshape(8, 64))
    rows = launch_mod.reduction_rows(view)
    assert torch.equal(rows, view) and (rows is not view) == copied
    assert rows.stride() == (view.shape[1], 1) and rows.data_ptr() % 16 == 0


# Weight shapes whose rule configs cover every tile the rule picks: 128 x 128 with and without
# K chunks, and the narrower tiles of Qwen2.5-1.5B's k/v (N = 256) and of a 512-wide k/v.
_RULE_SHAPES = [(151936, 1536), (1536, 1536), (256, 1536), (512, 3584)]


def _linear_cases():
    """(arch, dtype, config, parallel schedule, prologue): the fp16 and fp32 configs of a wide
    shape on every arch, with the prologue on sm_90; every distinct rule config in fp16 on sm_90."""
    for dtype in OTHER_DTYPES:
        default = linear_config("cuda", dtype, *_RULE_SHAPES[0])
        for arch in ARCHS:
            yield arch, dtype, default, False, linear_mod.PROLOGUE_NONE
        yield 90, dtype, default, False, linear_mod.PROLOGUE_SILU_MUL
    shape_configs = {linear_config("cuda", torch.float16, n, k) for n, k in _RULE_SHAPES}
    for cfg in sorted(shape_configs, key=str):
        yield 90, torch.float16, cfg, cfg.k_chunks > 1, linear_mod.PROLOGUE_NONE


@pytest.mark.fast_cells(4)
@pytest.mark.parametrize("arch, dtype, cfg, parallel, prologue", list(_linear_cases()), ids=str)
def test_linear_compiles(arch, dtype, cfg, parallel, prologue):
    dt = TL_DTYPE[dtype]
    compile_for(linear_mod._linear_kernel, arch,
                {"ptr": f"*{dt}", "y_ptr": "*fp32" if parallel else f"*{dt}"},
                dict(HAS_BIAS=True, K_CHUNKS=cfg.k_chunks, PARALLEL_CHUNKS=parallel, PROLOGUE=prologue,
                     BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
                     DOT_PRECISION=DOT_PRECISION),
                cfg.num_warps, cfg.num_stages)
    if parallel:
        compile_for(linear_mod._chunk_combine_kernel, arch, {"ptr": f"*{dt}", "part_ptr": "*fp32"},
                    dict(HAS_BIAS=True, BLOCK_N=1024))


@pytest.mark.fast_cells(2)
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", OTHER_DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_attention_compiles(arch, dtype, head_dim):
    cfg = attention_config("cuda", dtype, head_dim)
    compile_for(attention_mod._attention_kernel, arch,
                {"ptr": f"*{TL_DTYPE[dtype]}", "kv_start_ptr": "*i32", "kv_end_ptr": "*i32", "q_start_ptr": "*i32",
                 "scale": "fp32", **_WORKSPACE},
                dict(GROUP=6, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=head_dim, KV_CHUNK=cfg.kv_chunk,
                     DOT_PRECISION=DOT_PRECISION, STORE_LSE=False),
                cfg.num_warps, cfg.num_stages)


@pytest.mark.parametrize("dtype", OTHER_DTYPES, ids=str)
def test_paged_attention_compiles(dtype):
    """The engine's paged kernel, for sm_90 (one arch: each compile takes seconds on CPU)."""
    head_dim = 128
    cfg = attention_config("cuda", dtype, head_dim)
    compile_for(paged_mod._paged_attention_kernel, 90,
                {"ptr": f"*{TL_DTYPE[dtype]}", "query_starts_ptr": "*i32", "seq_lens_ptr": "*i32",
                 "block_tables_ptr": "*i32", "scale": "fp32", **_WORKSPACE},
                dict(GROUP=6, PAGE_SIZE=cfg.block_n, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=head_dim,
                     KV_CHUNK=cfg.kv_chunk, DOT_PRECISION=DOT_PRECISION),
                cfg.num_warps, cfg.num_stages)


@pytest.mark.fast_cells(2)
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", OTHER_DTYPES, ids=str)
def test_row_kernels_compile(arch, dtype):
    dt = f"*{TL_DTYPE[dtype]}"
    for hidden in (1536, 5120):
        block_rows, block_n, warps = rms_mod._launch_params(torch.device("cuda"), hidden)
        constexprs = dict(BLOCK_ROWS=block_rows, BLOCK_N=block_n)
        compile_for(rms_mod._rms_norm_kernel, arch, {"ptr": dt, "eps": "fp32"}, constexprs, warps)
    compile_for(silu_mod._silu_mul_kernel, arch, {"ptr": dt}, dict(BLOCK_ROWS=1, BLOCK_N=1024))
    block_v = logprobs_mod.vocab_block("cuda", 151936)
    compile_for(logprobs_mod._token_logprobs_kernel, arch,
                {"ptr": dt, "targets_ptr": "*i64", "logprob_ptr": "*fp32", "argmax_ptr": "*i32", "lse_ptr": "*fp32",
                 "temperature": "fp32"},
                dict(BLOCK_ROWS=1, BLOCK_V=block_v, STORE_LSE=False), 8)


def test_kernels_no_workload_reaches_compile():
    """The kernels no supported path launches today, for sm_90 in bf16: the exact GELU's backward
    (the vision towers are not trained) and the dequantization of a packed weight (tests use it)."""
    compile_for(exact_gelu_mod._gelu_backward_kernel, 90, {"ptr": "*bf16"}, dict(BLOCK_ROWS=1, BLOCK_N=1024))
    compile_for(quantized_mod._dequantize_kernel, 90, {"ptr": "*i32", "ws_ptr": "*bf16", "out_ptr": "*bf16"},
                dict(FORMAT=2, BITS=4, SCALE_GROUP_K=128, SCALE_GROUP_N=1, HAS_ZP=False, BLOCK_N=128, BLOCK_K=128))


@pytest.mark.heavy
@pytest.mark.parametrize("arch, dtype", [(80, torch.float32)], ids=str)
def test_linear_attention_kernels_compile(arch, dtype):
    """Gated DeltaNet's kernels at Qwen3.5's head sizes (128 x 128, two value heads per key head),
    the short convolution, the gated and zero-centred norms and the attention's output gate, in fp32
    on Ampere (the scan takes about 25 s to compile on CPU, in the heavy tier; bf16: the gate)."""
    dt = f"*{TL_DTYPE[dtype]}"
    compile_for(gdn_mod._chunk_gated_delta_rule_kernel, arch,
                {"ptr": dt, "state_ptr": "*fp32", "seg_start_ptr": "*i32", "seg_end_ptr": "*i32",
                 "out_from_ptr": "*i32", "a_log_ptr": "*fp32", "dt_bias_ptr": dt, "scale": "fp32"},
                dict(GROUP=2, CHUNK=gdn_mod.CHUNK, SUB=gdn_mod.SUB, MERGES=2, BLOCK_K=128,
                     BLOCK_V=gdn_mod.launch_block_v(torch.device("cuda"), 128)),
                gdn_mod.NUM_WARPS, 1)
    compile_for(conv_mod._causal_conv1d_silu_kernel, arch,
                {"ptr": dt, "seg_start_ptr": "*i32", "seg_end_ptr": "*i32", "out_from_ptr": "*i32"},
                dict(KERNEL=4, BLOCK_T=16, BLOCK_C=128))
    block_rows, block_n, warps = rms_mod._launch_params(torch.device("cuda"), 128)
    compile_for(gated_norm_mod._rms_norm_gated_kernel, arch, {"ptr": dt, "eps": "fp32"},
                dict(BLOCK_ROWS=block_rows, BLOCK_N=block_n), warps)
    compile_for(rms_mod._rms_norm_kernel, arch, {"ptr": dt, "eps": "fp32"},
                dict(BLOCK_ROWS=block_rows, BLOCK_N=block_n, ZERO_CENTRED=True), warps)
    compile_for(sigmoid_mod._sigmoid_mul_kernel, arch, {"ptr": dt}, dict(BLOCK_ROWS=1, BLOCK_N=1024))


def test_reduction_rows_traces_without_graph_breaks():
    """Under torch.compile (compiled decode) the row check reads no data pointer: one graph."""
    copy_rows = torch.compile(lambda x: launch_mod.reduction_rows(x[:, :3]) * 2, backend="eager", fullgraph=True)
    x = torch.randn(4, 8)
    assert torch.equal(copy_rows(x), x[:, :3] * 2)
