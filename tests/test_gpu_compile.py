"""Every kernel, with the configs used on CUDA, compiles for sm_80, sm_89 and sm_90.

Runs on CPU: Triton compiles to PTX and cubin without a GPU. This catches GPU-only codegen
errors (ops the interpreter accepts but the compiler rejects) on machines with no GPU. It
checks compilation, not speed or results; the gpu-marked tests check those on a GPU."""
import inspect
import sys

import pytest
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import invariant_infer.kernels  # noqa: F401  (loads the kernel modules)
from invariant_infer.kernels import LINEAR_CONFIGS, attention_config

configs_mod = sys.modules["invariant_infer.kernels.configs"]
linear_mod = sys.modules["invariant_infer.kernels.linear"]
attention_mod = sys.modules["invariant_infer.kernels.attention"]
paged_mod = sys.modules["invariant_infer.kernels.paged_attention"]
rms_mod = sys.modules["invariant_infer.kernels.rms_norm"]
silu_mod = sys.modules["invariant_infer.kernels.silu_mul"]
logprobs_mod = sys.modules["invariant_infer.kernels.token_logprobs"]

TL_DTYPE = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
ARCHS = [90, 89, 80]


def compile_for(kernel, arch, types, constexprs, num_warps=4, num_stages=3):
    """Compile ``kernel`` for sm_<arch>. ``types`` maps argument names to Triton types
    (default: pointers from the 'ptr' entry, everything else i32)."""
    signature = {}
    for name in inspect.signature(kernel.fn).parameters:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in types:
            signature[name] = types[name]
        else:
            signature[name] = types["ptr"] if name.endswith("_ptr") else "i32"
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})
    assert compiled.asm["cubin"]
    return compiled


def _offline_compiler_available() -> bool:
    try:
        compile_for(silu_mod._silu_mul_kernel, 90, {"ptr": "*fp32"}, {"BLOCK_ROWS": 1, "BLOCK_N": 16})
        return True
    except Exception:  # no CUDA backend or ptxas in this triton build
        return False


pytestmark = pytest.mark.skipif(not _offline_compiler_available(),
                                reason="this triton build cannot compile CUDA kernels offline")


def _linear_cases():
    """(arch, dtype, config, parallel schedule, prologue): the default configs and every distinct
    per-shape config on every arch; fp16, the parallel schedule and the prologues on sm_90 only,
    to keep the suite short."""
    for dtype in TL_DTYPE:
        default = configs_mod._DEFAULT_CONFIGS[("cuda", dtype)]
        for arch in ARCHS:
            yield arch, dtype, default, False, linear_mod.PROLOGUE_NONE
        yield 90, dtype, default, False, linear_mod.PROLOGUE_SILU_MUL
        yield 90, dtype, default, False, linear_mod.PROLOGUE_RMS_NORM
    shape_configs = {cfg for (device, _, _, _), cfg in LINEAR_CONFIGS.items() if device == "cuda"}
    for cfg in sorted(shape_configs, key=str):
        for arch in ARCHS:
            yield arch, torch.bfloat16, cfg, False, linear_mod.PROLOGUE_NONE
        yield 90, torch.float16, cfg, False, linear_mod.PROLOGUE_NONE
        if cfg.k_chunks > 1:
            yield 90, torch.bfloat16, cfg, True, linear_mod.PROLOGUE_NONE


@pytest.mark.parametrize("arch, dtype, cfg, parallel, prologue", list(_linear_cases()), ids=str)
def test_linear_compiles(arch, dtype, cfg, parallel, prologue):
    dt = TL_DTYPE[dtype]
    compile_for(linear_mod._linear_kernel, arch,
                {"ptr": f"*{dt}", "rstd_ptr": "*fp32", "y_ptr": "*fp32" if parallel else f"*{dt}"},
                dict(HAS_BIAS=True, K_CHUNKS=cfg.k_chunks, PARALLEL_CHUNKS=parallel, PROLOGUE=prologue,
                     BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
                     DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32"),
                cfg.num_warps, cfg.num_stages)
    if parallel:
        compile_for(linear_mod._chunk_combine_kernel, arch, {"ptr": f"*{dt}", "part_ptr": "*fp32"},
                    dict(HAS_BIAS=True, K_CHUNKS=cfg.k_chunks, BLOCK_N=1024))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", list(TL_DTYPE), ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_attention_compiles(arch, dtype, head_dim):
    cfg = attention_config("cuda", dtype, head_dim)
    compile_for(attention_mod._attention_kernel, arch,
                {"ptr": f"*{TL_DTYPE[dtype]}", "kv_start_ptr": "*i32", "kv_end_ptr": "*i32", "q_start_ptr": "*i32",
                 "scale": "fp32"},
                dict(GROUP=6, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=head_dim,
                     DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32"),
                cfg.num_warps, cfg.num_stages)


@pytest.mark.parametrize("dtype", list(TL_DTYPE), ids=str)
def test_paged_attention_compiles(dtype):
    """The engine's paged kernel, for sm_90 (one arch: each compile takes seconds on CPU)."""
    head_dim = 128
    cfg = attention_config("cuda", dtype, head_dim)
    compile_for(paged_mod._paged_attention_kernel, 90,
                {"ptr": f"*{TL_DTYPE[dtype]}", "query_starts_ptr": "*i32", "seq_lens_ptr": "*i32",
                 "block_tables_ptr": "*i32", "scale": "fp32"},
                dict(GROUP=6, PAGE_SIZE=cfg.block_n, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=head_dim,
                     DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32"),
                cfg.num_warps, cfg.num_stages)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", list(TL_DTYPE), ids=str)
def test_row_kernels_compile(arch, dtype):
    dt = f"*{TL_DTYPE[dtype]}"
    for hidden in (1536, 5120):
        block_rows, block_n, warps = rms_mod._launch_params(torch.device("cuda"), hidden)
        constexprs = dict(BLOCK_ROWS=block_rows, BLOCK_N=block_n)
        compile_for(rms_mod._rms_norm_kernel, arch, {"ptr": dt, "eps": "fp32"}, constexprs, warps)
        compile_for(rms_mod._rms_rstd_kernel, arch, {"ptr": dt, "rstd_ptr": "*fp32", "eps": "fp32"}, constexprs, warps)
    compile_for(silu_mod._silu_mul_kernel, arch, {"ptr": dt}, dict(BLOCK_ROWS=1, BLOCK_N=1024))
    block_v = logprobs_mod.vocab_block("cuda", 151936)
    compile_for(logprobs_mod._token_logprobs_kernel, arch,
                {"ptr": dt, "targets_ptr": "*i64", "logprob_ptr": "*fp32", "argmax_ptr": "*i32"},
                dict(BLOCK_ROWS=1, BLOCK_V=block_v), 8)
