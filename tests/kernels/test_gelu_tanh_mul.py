"""gelu_tanh(gate) * up (Gemma's MLP): torch's two ops' bits up to the activation's last rounding
(fp32 exact within 2 ulps), a row alone == in any batch, and gradients against float64."""
import pytest
import torch
import torch.nn.functional as F

from helpers.models import DTYPES
from invariant_infer.kernels import gelu_tanh_mul, gelu_tanh_mul_autograd

TOLERANCE = {torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10, torch.float32: 1e-6}  # relative to max |y|


@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_torch_and_rows_alone_equal_any_batch(dtype):
    g = torch.Generator().manual_seed(0)
    gate, up = (torch.randn(37, 300, generator=g).mul(3).to(dtype) for _ in range(2))
    out = gelu_tanh_mul(gate, up)
    want = F.gelu(gate.double(), approximate="tanh") * up.double()
    assert (out.double() - want).abs().max().item() <= TOLERANCE[dtype] * want.abs().max().item()
    for rows in (slice(0, 1), slice(5, 6), slice(3, 20)):
        assert torch.equal(gelu_tanh_mul(gate[rows], up[rows]), out[rows])
    silu = F.silu(gate.double()) * up.double()  # another activation is far off: the test sees which one runs
    assert (out.double() - silu).abs().max().item() > 0.01 * want.abs().max().item()


def test_gradients_against_float64():
    g = torch.Generator().manual_seed(1)
    gate, up = (torch.randn(9, 70, generator=g).mul(2).requires_grad_() for _ in range(2))
    grad = torch.randn(9, 70, generator=g)
    gelu_tanh_mul_autograd(gate, up).backward(grad)
    gate64, up64 = (t.detach().double().requires_grad_() for t in (gate, up))
    (F.gelu(gate64, approximate="tanh") * up64).backward(grad.double())
    assert (gate.grad.double() - gate64.grad).abs().max().item() < 1e-5
    assert (up.grad.double() - up64.grad).abs().max().item() < 1e-5
    assert torch.equal(gelu_tanh_mul_autograd(gate, up).detach(), gelu_tanh_mul(gate.detach(), up.detach()))
