"""gelu (erf form, Qwen2.5-VL's merger; tanh form, Qwen3-VL's vision MLP): torch's bits up to the last
rounding, a row alone == in any batch, and the gradients of both forms against float64, a row's alone ==
in any batch."""
import pytest
import torch
import torch.nn.functional as F

from helpers.models import DTYPES
from invariant_infer.kernels import gelu, gelu_autograd, gelu_tanh_mul_autograd

TOLERANCE = {torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11, torch.float32: 1e-6}  # relative to max |y|


@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_float64_and_rows_alone_equal_any_batch(dtype):
    x = torch.randn(37, 300, generator=torch.Generator().manual_seed(0)).mul(3).to(dtype)
    out = gelu(x)
    want = F.gelu(x.double())
    assert (out.double() - want).abs().max().item() <= TOLERANCE[dtype] * want.abs().max().item()
    for rows in (slice(0, 1), slice(5, 6), slice(3, 20)):
        assert torch.equal(gelu(x[rows]), out[rows])
    if dtype == torch.float32:  # the tanh form is 400x further off: the test sees which GELU runs
        tanh_form = F.gelu(x.double(), approximate="tanh")
        assert (out.double() - want).abs().max().item() * 100 < (tanh_form - want).abs().max().item()


def test_gradient_against_float64():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(9, 70, generator=g).mul(2).requires_grad_()
    grad = torch.randn(9, 70, generator=g)
    gelu_autograd(x).backward(grad)
    x64 = x.detach().double().requires_grad_()
    F.gelu(x64).backward(grad.double())
    assert (x.grad.double() - x64.grad).abs().max().item() < 1e-5
    assert torch.equal(gelu_autograd(x).detach(), gelu(x.detach()))


@pytest.mark.parametrize("dtype", DTYPES)
def test_tanh_form_is_gelu_tanh_mul_by_one(dtype):
    """The tanh form computes what gelu_tanh(gate) * up does for up = 1 (its rounded activation), bitwise."""
    from invariant_infer.kernels import gelu_tanh_mul
    x = torch.randn(37, 300, generator=torch.Generator().manual_seed(2)).mul(3).to(dtype)
    out = gelu(x, approximate="tanh")
    assert torch.equal(out, gelu_tanh_mul(x, torch.ones_like(x)))
    assert not torch.equal(out, gelu(x))
    for rows in (slice(0, 1), slice(3, 20)):
        assert torch.equal(gelu(x[rows], approximate="tanh"), out[rows])


GRAD_TOLERANCE = {torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10, torch.float32: 2e-6}  # relative to max |dx|


def gelu_grad(x, dy, approximate):
    leaf = x.detach().requires_grad_()
    (dx,) = torch.autograd.grad(gelu_autograd(leaf, approximate), (leaf,), dy)
    return dx


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gradients_of_both_forms_match_float64_and_rows_alone_equal_any_batch(dtype, approximate):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(37, 300, generator=g).mul(3).to(dtype)
    dy = torch.randn(37, 300, generator=g).to(dtype)
    dx = gelu_grad(x, dy, approximate)
    assert dx.dtype == dtype
    x64 = x.double().requires_grad_()
    (want,) = torch.autograd.grad(F.gelu(x64, approximate=approximate), (x64,), dy.double())
    scale = want.abs().max().item()
    assert (dx.double() - want).abs().max().item() <= GRAD_TOLERANCE[dtype] * scale
    for rows in (slice(0, 1), slice(5, 6), slice(3, 20), torch.randperm(37)):
        assert torch.equal(gelu_grad(x[rows], dy[rows], approximate), dx[rows])
    if dtype == torch.float32:  # the tolerance sees the other form's gradient
        other = "tanh" if approximate == "none" else "none"
        (wrong,) = torch.autograd.grad(F.gelu(x64, approximate=other), (x64,), dy.double())
        assert (dx.double() - wrong).abs().max().item() > 100 * GRAD_TOLERANCE[dtype] * scale


def test_tanh_form_gradient_is_gelu_tanh_mul_gate_gradient_by_one():
    """d x of the tanh form is d gate of gelu_tanh(gate) * up at up = 1, bitwise: one slope for both."""
    g = torch.Generator().manual_seed(4)
    x, dy = torch.randn(20, 96, generator=g).mul(3).bfloat16(), torch.randn(20, 96, generator=g).bfloat16()
    gate, up = x.clone().requires_grad_(), torch.ones_like(x).requires_grad_()
    (dgate,) = torch.autograd.grad(gelu_tanh_mul_autograd(gate, up), (gate,), dy)
    assert torch.equal(gelu_grad(x, dy, "tanh"), dgate)


def test_negative_control_torch_cpu_gelu_backward_tail_moves_with_the_batch():
    """torch's CPU gelu backward splits a vectorized body from a scalar tail: the same rows in a batch of
    another size can come out with other bits, which the kernel's row test above would catch."""
    g = torch.Generator().manual_seed(5)
    x, dy = torch.randn(37, 300, generator=g).mul(3), torch.randn(37, 300, generator=g)

    def torch_grad(rows):
        leaf = x[rows].clone().requires_grad_()
        (dx,) = torch.autograd.grad(F.gelu(leaf, approximate="tanh"), (leaf,), dy[rows])
        return dx

    full = torch_grad(slice(0, 37))
    assert any(not torch.equal(torch_grad(slice(i, i + 1)), full[i:i + 1]) for i in range(37))
