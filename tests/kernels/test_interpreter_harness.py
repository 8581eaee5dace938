"""The CPU harness on its own: fixed-order dot, round-to-nearest-even bf16 casts, scalar indices."""
import warnings

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from packaging.version import Version

from triton.runtime import interpreter

from invariant_infer.kernels import interpreter_harness
from invariant_infer.kernels.interpreter_harness import (
    bf16_bits_to_fp32, fixed_order_dot, fp32_to_bf16_bits_rne, interpreted, patched_interpreter, sequential_dot)

# Bounds on the relative error of the 200x1536 @ 1536x128 product below against float64;
# measured on 1536x512: bf16 1.7e-3, fp16 2.1e-4, fp32 1.8e-7. (Each output element's order is
# over K alone: two 64-wide N tiles test the same order as eight.)
DOT_TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 1e-3, torch.float32: 1e-5}


def _sequential_dot(a, b):
    out = np.zeros((a.shape[0], b.shape[1]), np.float32)
    for k in range(a.shape[1]):
        out += a[:, k:k + 1] * b[k:k + 1, :]
    return out


@pytest.mark.parametrize("dot", [sequential_dot, fixed_order_dot], ids=["definition", "in_use"])
def test_fixed_order_dot_sums_k_sequentially_for_every_element(dot):
    rng = np.random.default_rng(0)
    for m, k, n in [(1, 64, 64), (64, 64, 64), (16, 256, 128), (7, 33, 5), (32, 512, 256), (3, 1, 16)]:
        a = rng.standard_normal((m, k)).astype(np.float32)
        b = rng.standard_normal((k, n)).astype(np.float32)
        # Starting from 0 + p0 + p1 ... is the same order as reducing from p0.
        assert np.array_equal(dot(a, b), _sequential_dot(a, b))
        # Non-contiguous operands (transposed loads) take the same path.
        assert np.array_equal(dot(np.asfortranarray(a), np.asfortranarray(b)), _sequential_dot(a, b))


def test_fixed_order_dot_is_row_position_invariant():
    rng = np.random.default_rng(1)
    a = rng.standard_normal((64, 128)).astype(np.float32)
    b = rng.standard_normal((128, 64)).astype(np.float32)
    full = fixed_order_dot(a, b)
    perm = rng.permutation(64)
    assert np.array_equal(fixed_order_dot(a[perm], b), full[perm])
    assert np.array_equal(fixed_order_dot(a[5:6], b)[0], full[5])


def test_rne_cast_matches_torch_bitwise():
    rng = np.random.default_rng(2)
    x = rng.standard_normal(100_000).astype(np.float32) * np.float32(3.0)
    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 3.4e38, -3.4e38, 1e-40, 1.00390625, 1.01171875],
                        np.float32)
    x = np.concatenate([x, specials])
    ours = fp32_to_bf16_bits_rne(x)
    expected = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    finite = ~np.isnan(x)
    assert np.array_equal(ours[finite], expected[finite])
    assert np.isnan(bf16_bits_to_fp32(ours[~finite])).all()


@triton.jit
def _matmul_kernel(a_ptr, b_ptr, c_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), tl.float32)
    for k0 in range(0, K, BK):
        a = tl.load(a_ptr + rm[:, None] * K + (k0 + rk)[None, :], mask=(rm[:, None] < M) & ((k0 + rk)[None, :] < K))
        b = tl.load(b_ptr + (k0 + rk)[:, None] * N + rn[None, :], mask=((k0 + rk)[:, None] < K) & (rn[None, :] < N))
        acc = tl.dot(a, b, acc)
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def _run_matmul(a, b, stock_dot: bool = False):
    m, k = a.shape
    n = b.shape[1]
    c = torch.empty(m, n, dtype=a.dtype)
    grid = (triton.cdiv(m, 64), triton.cdiv(n, 64))
    with patched_interpreter():
        builder = interpreter.InterpreterBuilder
        fixed_dot = builder.create_dot
        if stock_dot:  # keep the rest of the harness, put the interpreter's own dot back
            builder.create_dot = interpreter_harness._saved["create_dot"]
        try:
            interpreted(_matmul_kernel)[grid](a, b, c, m, n, k, BM=64, BN=64, BK=64)
        finally:
            builder.create_dot = fixed_dot
    return c


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_harnessed_dot_accuracy_and_row_invariance(dtype):
    torch.manual_seed(0)
    a = torch.randn(200, 1536).to(dtype)
    b = (torch.randn(1536, 128) / 40).to(dtype)
    c = _run_matmul(a, b)
    ref = a.double() @ b.double()
    rel = ((c.double() - ref).norm() / ref.norm()).item()
    assert rel < DOT_TOLERANCE[dtype]
    assert torch.equal(_run_matmul(a[77:78], b)[0], c[77])
    perm = torch.randperm(200)
    assert torch.equal(_run_matmul(a[perm], b), c[perm])


def test_stock_interpreter_bf16_dot_is_wrong():
    """Negative control: without the harness, the interpreter multiplies bf16 bit patterns."""
    torch.manual_seed(0)
    a = torch.randn(64, 128).bfloat16()
    b = torch.randn(128, 64).bfloat16()
    ref = a.double() @ b.double()
    stock = _run_matmul(a, b, stock_dot=True)
    assert ((stock.double() - ref).norm() / ref.norm()).item() > 1.0


@triton.jit
def _count_kernel(out_ptr, n):
    start = tl.program_id(0)  # a computed loop bound: a scalar the interpreter holds as a 1-element array
    total = 0
    for _ in range(start, start + n):
        total += 1
    tl.store(out_ptr + start, total)


def _run_count(scalar_index_fix: bool):
    out = torch.zeros(3, dtype=torch.int32)
    with patched_interpreter():
        patched = interpreter._patch_lang_tensor
        if not scalar_index_fix:  # keep the rest of the harness, put the interpreter's own conversion back
            interpreter._patch_lang_tensor = interpreter_harness._saved_patch_lang_tensor[0]
        try:
            interpreted(_count_kernel)[(3,)](out, 5)
        finally:
            interpreter._patch_lang_tensor = patched
    return out


def test_loop_over_computed_bounds_runs_without_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        assert _run_count(scalar_index_fix=True).tolist() == [5, 5, 5]


def test_scalar_index_fix_installed_exactly_where_the_stock_conversion_fails():
    """Triton < 3.7 converts with int() of a 1-element array: numpy 2.4 refuses it, numpy >= 1.25 warns."""
    assert interpreter_harness.SCALAR_INDEX_FIX_NEEDED == (Version(triton.__version__).release < (3, 7))
    if not interpreter_harness.SCALAR_INDEX_FIX_NEEDED:
        pytest.skip(f"Triton {triton.__version__} converts scalars itself")
    # Negative control: the stock conversion on this Triton and numpy fails, or warns.
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        with pytest.raises((interpreter.InterpreterError, DeprecationWarning, TypeError)):
            _run_count(scalar_index_fix=False)


def test_fp8_cast_rounds_to_nearest_even_and_saturates():
    from invariant_infer.kernels.interpreter_harness import fp32_to_fp8e4m3_bits
    x = (torch.randn(4096) * 100).float()
    x[:3] = torch.tensor([124.4, 1e6, -1e6])
    got = torch.from_numpy(fp32_to_fp8e4m3_bits(x.numpy())).view(torch.float8_e4m3fn).float()
    assert torch.equal(got, x.clamp(-448, 448).to(torch.float8_e4m3fn).float())
    assert got[0].item() == 128.0 and got[1].item() == 448.0


@triton.jit
def _fma_kernel(x_ptr, y_ptr, z_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    y = tl.load(y_ptr + offs, mask=mask)
    z = tl.load(z_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, tl.fma(x, y, z), mask=mask)


def test_fma_rounds_once_as_the_gpus_in_every_triton_release():
    """(1 + 2^-12)^2 - (1 + 2^-11) is 2^-24 exactly; multiplying then adding rounds the product to
    1 + 2^-11 first and gives 0 (Triton < 3.7's interpreter). The interpreted tl.fma must give the
    fused result, and equal Triton's own correctly rounded fma where this release has one."""
    one_plus = 1 + 2.0 ** -12
    x = torch.tensor([one_plus, 3.0, -1.5], dtype=torch.float32)
    z = torch.tensor([-(1 + 2.0 ** -11), 1.0, 0.25], dtype=torch.float32)
    out = torch.empty(3, dtype=torch.float32)
    with patched_interpreter():
        interpreted(_fma_kernel)[(1,)](x, x, z, out, 3, BLOCK=4)
    assert out[0].item() == 2.0 ** -24 and (x[0] * x[0] + z[0]).item() == 0.0  # the two-rounding control
    assert out[1:].tolist() == [10.0, 2.5]
    rng = np.random.default_rng(0)
    a, b, c = (rng.standard_normal(50_000).astype(np.float32) * np.exp2(rng.integers(-30, 30, 50_000)).astype(np.float32)
               for _ in range(3))
    c = np.where(np.arange(50_000) % 2 == 0, -(a * b), c).astype(np.float32)  # heavy cancellation in half of them
    ours = interpreter_harness.fma_fp32(a, b, c)
    exact = [float(np.float32(float(np.longdouble(p) * np.longdouble(q) + np.longdouble(r))))
             for p, q, r in zip(a[:2000], b[:2000], c[:2000])]  # the product exact in a 64-bit mantissa
    assert ours[:2000].tolist() == exact
    native = getattr(getattr(interpreter, "_interpreter", None), "fma_fp32", None)
    if native is not None:  # Triton >= 3.7's interpreter: its own fma, correctly rounded
        assert np.array_equal(ours.view(np.uint32), native(a, b, c).view(np.uint32))
