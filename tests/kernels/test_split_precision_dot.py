"""The split-precision tensor-core products on fp32 operands, against float64: bf16x3 within 2^-15
of sum |a||b| and far better than one bf16 product; bf16x6 within fp32's own bound (as an IEEE fp32
dot). The interpreted split rounds fp32 -> bf16 to nearest even as the GPU does (torch's cast,
bitwise), and a batched 3-D product is bitwise each entry's own 2-D product."""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from invariant_infer.kernels.launch import launch
from invariant_infer.kernels.split_precision_dot import dot_bf16x3, dot_bf16x6, split_bf16

M, K, N = 32, 128, 32
BF16X3_BOUND = 2.0 ** -15  # relative to sum_k |a_ik b_kj|: hi + lo holds x within 2^-17 |x|
FP32_BOUND = 2.0 ** -20    # an fp32 sum over K = 128 in one order: measured 2^-22
PRODUCTS = {"bf16": 0, "bf16x3": 1, "bf16x6": 2, "ieee": 3}


@triton.jit
def _product_kernel(a_ptr, b_ptr, out_ptr, PRODUCT: tl.constexpr, BATCH: tl.constexpr, M: tl.constexpr,
                    K: tl.constexpr, N: tl.constexpr):
    batch = tl.arange(0, BATCH)[:, None, None]
    a = tl.load(a_ptr + batch * M * K + tl.arange(0, M)[None, :, None] * K + tl.arange(0, K)[None, None, :])
    b = tl.load(b_ptr + batch * K * N + tl.arange(0, K)[None, :, None] * N + tl.arange(0, N)[None, None, :])
    if BATCH == 1:  # the 2-D product
        a = tl.reshape(a, (M, K))
        b = tl.reshape(b, (K, N))
    acc = tl.zeros(a.shape[:-1] + b.shape[-1:], tl.float32)
    if PRODUCT == 0:
        acc = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), acc)
    elif PRODUCT == 1:
        acc = dot_bf16x3(a, b, acc)
    elif PRODUCT == 2:
        acc = dot_bf16x6(a, b, acc)
    else:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    tl.store(out_ptr + batch * M * N + tl.arange(0, M)[None, :, None] * N + tl.arange(0, N)[None, None, :],
             tl.reshape(acc, (BATCH, M, N)))


@triton.jit
def _split_kernel(x_ptr, hi_ptr, lo_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    hi, lo = split_bf16(tl.load(x_ptr + offs))
    tl.store(hi_ptr + offs, hi)
    tl.store(lo_ptr + offs, lo)


def product(a: torch.Tensor, b: torch.Tensor, name: str) -> torch.Tensor:
    """a [B, M, K] @ b [B, K, N] in fp32 by the named product (B = 1: a 2-D product)."""
    out = torch.empty(a.shape[0], M, N)
    launch(_product_kernel, (1,), a.device, a, b, out, PRODUCT=PRODUCTS[name], BATCH=a.shape[0], M=M, K=K, N=N)
    return out


def relative_error(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> float:
    exact = a.double() @ b.double()
    return ((out.double() - exact).abs() / (a.double().abs() @ b.double().abs())).max().item()


@pytest.fixture(scope="module")
def operands():
    g = torch.Generator().manual_seed(0)
    return torch.randn(1, M, K, generator=g), torch.randn(1, K, N, generator=g) * 100


def test_bf16x3_is_within_its_bound_and_far_better_than_one_bf16_product(operands):
    a, b = operands
    errors = {name: relative_error(product(a, b, name), a, b) for name in ("bf16", "bf16x3")}
    assert errors["bf16x3"] <= BF16X3_BOUND
    assert errors["bf16x3"] * 100 < errors["bf16"], errors


def test_bf16x6_is_as_accurate_as_an_fp32_dot(operands):
    a, b = operands
    errors = {name: relative_error(product(a, b, name), a, b) for name in ("bf16x6", "ieee", "bf16x3")}
    assert errors["bf16x6"] <= FP32_BOUND and errors["ieee"] <= FP32_BOUND
    assert errors["bf16x3"] > FP32_BOUND, errors  # the bound tells the two apart


def test_a_batched_product_is_each_entrys_own_product():
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(4, M, K, generator=g), torch.randn(4, K, N, generator=g)
    for name in ("bf16x3", "bf16x6"):
        batched = product(a, b, name)
        for i in range(4):
            assert torch.equal(batched[i], product(a[i:i + 1], b[i:i + 1], name)[0])


def test_the_split_rounds_to_nearest_even_as_the_gpu():
    """hi is torch's (round-to-nearest-even) bf16 of x bitwise, ties included; lo is bf16(x - hi)."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1024, generator=g) * 3
    x[:4] = torch.tensor([1.00390625, 1.01171875, -1.00390625, 3.0])  # exact ties: to even
    hi, lo = torch.empty(1024, dtype=torch.bfloat16), torch.empty(1024, dtype=torch.bfloat16)
    launch(_split_kernel, (1,), x.device, x, hi, lo, BLOCK=1024)
    assert torch.equal(hi.view(torch.int16), x.to(torch.bfloat16).view(torch.int16))
    assert torch.equal(lo.view(torch.int16), (x - hi.float()).to(torch.bfloat16).view(torch.int16))
    assert hi[1].item() == 1.015625  # a tie rounded to even (truncation gives 1.0078125)
