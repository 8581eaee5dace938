"""silu*mul's autograd: the forward's bits, gradients against float64, row invariance, run-twice bits.

No gradcheck: the kernels compute in fp32 and take bf16/fp16/fp32 only, so float64 is not theirs.
"""
import sys

import pytest
import torch

from helpers.kernel_compile import compile_for
from helpers.models import DEVICES, DTYPES
from invariant_infer.kernels import silu_mul, silu_mul_autograd

autograd_mod = sys.modules["invariant_infer.kernels.silu_mul_autograd"]
launch_mod = sys.modules["invariant_infer.kernels.launch"]

# Max |error| / max |float64 gradient|: a rounding of silu(gate) to the dtype (d up) and one of
# the result, on fp32 arithmetic.
TOLERANCE = {torch.bfloat16: 8e-3, torch.float16: 1e-3, torch.float32: 1e-6}


def inputs(rows, dtype, device, n=300):
    g = (torch.randn(rows, n) * 4).to(dtype).to(device)
    u = torch.randn(rows, n).to(dtype).to(device)
    dy = torch.randn(rows, n).to(dtype).to(device)
    return g, u, dy


def kernel_grads(g, u, dy):
    g, u = g.detach().requires_grad_(), u.detach().requires_grad_()
    return torch.autograd.grad(silu_mul_autograd(g, u), (g, u), dy)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_is_silu_mul_and_gradients_match_float64(dtype, device):
    g, u, dy = inputs(21, dtype, device)
    gr, ur = g.detach().requires_grad_(), u.detach().requires_grad_()
    y = silu_mul_autograd(gr, ur)
    assert torch.equal(y, silu_mul(g, u))
    dg, du = torch.autograd.grad(y, (gr, ur), dy)
    g64, u64 = g.double().requires_grad_(), u.double().requires_grad_()
    ref = torch.autograd.grad(torch.nn.functional.silu(g64) * u64, (g64, u64), dy.double())
    for got, want in zip((dg, du), ref):
        assert got.dtype == dtype and got.shape == want.shape
        assert ((got.double() - want).abs().max() / want.abs().max()).item() < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_same_inputs_give_the_same_gradient_bits(dtype):
    g, u, dy = inputs(21, dtype, "cpu")
    first, second = kernel_grads(g, u, dy), kernel_grads(g, u, dy)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def row_mismatches(grads, g, u, dy) -> list:
    """The row subsets (slices, a permutation) whose gradients differ from theirs in the full batch."""
    full = grads(g, u, dy)
    subsets = [slice(3, 4), slice(0, 1), slice(20, 33), slice(5, 30), torch.randperm(g.shape[0])]
    return [rows for rows in subsets
            if not all(torch.equal(a, b[rows]) for a, b in zip(grads(g[rows], u[rows], dy[rows]), full))]


@pytest.mark.parametrize("dtype", DTYPES)
def test_input_gradients_of_a_row_do_not_depend_on_the_other_rows(dtype):
    assert row_mismatches(kernel_grads, *inputs(33, dtype, "cpu")) == []


def rows_keyed_grads(g, u, dy):
    """Negative control: the kernel for up to 4 rows, another (equal in exact arithmetic) association
    of d gate's product for more, as a backward that picks its code path by the batch size."""
    if g.shape[0] <= 4:
        return kernel_grads(g, u, dy)
    gf, uf, dyf = g.float(), u.float(), dy.float()
    sig = torch.sigmoid(gf)
    dg = (dyf * sig) * (uf * (1 + gf * (1 - sig)))
    return dg.to(g.dtype), (dyf * (gf * sig).to(g.dtype).float()).to(g.dtype)


def test_negative_control_rows_keyed_backward_is_caught():
    assert row_mismatches(rows_keyed_grads, *inputs(33, torch.float32, "cpu")) != []


@pytest.mark.parametrize("arch", [90, 89, 80])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_backward_kernel_compiles_for_cuda(arch, dtype):
    """Offline (no GPU needed): the kernel with the CUDA launch's blocks and pinned options."""
    element = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}[dtype]
    assert compile_for(autograd_mod._silu_mul_backward_kernel, arch, {"ptr": element},
                       dict(BLOCK_ROWS=1, BLOCK_N=1024), 4)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_up_gradient_uses_the_forwards_rounded_silu(dtype):
    """With a gradient of ones, d(up) is silu(gate) as the forward rounds it: bitwise silu_mul(gate, 1)."""
    gate = torch.randn(5, 96).to(dtype)
    up = torch.randn(5, 96).to(dtype).requires_grad_()
    silu_mul_autograd(gate, up).backward(torch.ones(5, 96, dtype=dtype))
    assert torch.equal(up.grad, silu_mul(gate, torch.ones_like(gate)))
