"""gelu (erf form, Qwen2.5-VL's merger): torch's bits up to the last rounding, a row alone == in any
batch, and the gradient against float64."""
import pytest
import torch
import torch.nn.functional as F

from helpers.models import DTYPES
from invariant_infer.kernels import gelu, gelu_autograd

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
