"""Autograd through the fused MLP projection silu_mul_linear: the fused forward's bits, and gradients
bitwise equal to those of the unfused pair linear(silu_mul(gate, up)), which are row-invariant and
deterministic (tests/kernels/test_linear_autograd.py, tests/kernels/test_silu_mul_autograd.py)."""
import pytest
import torch

from helpers.models import DEVICES, DTYPES
from invariant_infer.kernels import linear_autograd, silu_mul_autograd, silu_mul_linear_autograd
from invariant_infer.kernels.fused_linear import silu_mul_linear

TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float32: 1e-5}


def operands(rows, dtype, device, k=96, n=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    gate = (torch.randn(rows, k, generator=g) * 2).to(dtype).to(device)
    up = torch.randn(rows, k, generator=g).to(dtype).to(device)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype).to(device)
    b = torch.randn(n, generator=g).to(dtype).to(device)
    dy = torch.randn(rows, n, generator=g).to(dtype).to(device)
    return gate, up, w, b, dy


def grads(fn, gate, up, w, b, dy):
    leaves = [t.detach().requires_grad_() for t in (gate, up, w, b)]
    y = fn(*leaves)
    y.backward(dy)
    return (y.detach(), *(t.grad for t in leaves))


def unfused(gate, up, w, b):
    return linear_autograd(silu_mul_autograd(gate, up), w, b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_forward_and_unfused_gradients_bit_for_bit(dtype, device):
    ops = operands(19, dtype, device)
    fused = grads(silu_mul_linear_autograd, *ops)
    assert torch.equal(fused[0], silu_mul_linear(*ops[:4]))
    assert all(torch.equal(a, c) for a, c in zip(fused, grads(unfused, *ops)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_gradients_match_float64(dtype):
    gate, up, w, b, dy = operands(19, dtype, "cpu")
    _, *got = grads(silu_mul_linear_autograd, gate, up, w, b, dy)
    ref = [t.double().requires_grad_() for t in (gate, up, w, b)]
    torch.nn.functional.linear(torch.nn.functional.silu(ref[0]) * ref[1], ref[2], ref[3]).backward(dy.double())
    for name, g, r in zip(("gate", "up", "weight", "bias"), got, ref):
        assert g.dtype == dtype
        assert ((g.double() - r.grad).abs().max() / r.grad.abs().max()).item() < TOLERANCE[dtype], name


def test_same_micro_batch_gives_the_same_bits_twice():
    ops = operands(19, torch.bfloat16, "cpu")
    assert all(torch.equal(a, c) for a, c in zip(grads(silu_mul_linear_autograd, *ops),
                                                 grads(silu_mul_linear_autograd, *ops)))


def test_input_gradients_of_a_row_do_not_depend_on_the_other_rows():
    gate, up, w, b, dy = operands(23, torch.bfloat16, "cpu")
    full = grads(silu_mul_linear_autograd, gate, up, w, b, dy)
    for rows in (slice(0, 1), slice(4, 7), slice(5, 23)):
        alone = grads(silu_mul_linear_autograd, gate[rows], up[rows], w, b, dy[rows])
        assert torch.equal(alone[0], full[0][rows])
        assert torch.equal(alone[1], full[1][rows]) and torch.equal(alone[2], full[2][rows])
