"""tanh (the encoders' poolers and classification heads): within tolerance of float64, also near 0 where
1 - 2 / (exp(2x) + 1) cancels, and a row alone == in any batch; its gradient likewise, also where
1 - tanh(x)^2 cancels."""
import sys

import pytest
import torch

from helpers.kernel_compile import compile_for
from helpers.models import DTYPES
from invariant_infer.kernels.tanh import tanh, tanh_autograd

tanh_mod, gelu_mod = (sys.modules[f"invariant_infer.kernels.{name}"] for name in ("tanh", "gelu"))

TOLERANCE = {torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11, torch.float32: 2e-6}  # relative, per element


@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_float64_and_rows_alone_equal_any_batch(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(20, 96, generator=g) * 3, torch.randn(17, 96, generator=g) * 0.05]).to(dtype)
    x[0, :4] = torch.tensor([0.0, 40.0, -40.0, 0.125])
    out = tanh(x)
    want = torch.tanh(x.double())
    error = ((out.double() - want).abs() / want.abs().clamp(min=torch.finfo(dtype).tiny)).max().item()
    assert error <= TOLERANCE[dtype], error
    for rows in (slice(0, 1), slice(25, 26), slice(3, 30)):
        assert torch.equal(tanh(x[rows]), out[rows])


def test_negative_control_the_tolerance_sees_the_cancelling_form_near_zero():
    x = torch.full((1, 8), 1e-5)
    cancelling = 1.0 - 2.0 / (torch.exp(2.0 * x) + 1.0)
    assert ((cancelling.double() - torch.tanh(x.double())).abs() / 1e-5).max().item() > 100 * TOLERANCE[torch.float32]
    assert ((tanh(x).double() - torch.tanh(x.double())).abs() / 1e-5).max().item() <= TOLERANCE[torch.float32]


def tanh_grad(x, dy):
    leaf = x.detach().requires_grad_()
    y = tanh_autograd(leaf)
    assert torch.equal(y.detach(), tanh(x))
    (dx,) = torch.autograd.grad(y, (leaf,), dy)
    return dx


def sech_squared(x64):
    return 1.0 / torch.cosh(x64) ** 2  # float64; 1 - tanh^2 would cancel to 0 past |x| ~ 19


@pytest.mark.parametrize("dtype", DTYPES)
def test_gradient_matches_float64_and_rows_alone_equal_any_batch(dtype):
    """Per element, relative: the slope 4 / (exp(x) + exp(-x))^2 keeps its accuracy at large |x| too."""
    g = torch.Generator().manual_seed(1)
    x = torch.cat([torch.randn(20, 96, generator=g) * 3, torch.randn(17, 96, generator=g) * 0.05]).to(dtype)
    x[0, :4] = torch.tensor([0.0, 12.0, -12.0, 0.125])
    dy = torch.randn(37, 96, generator=g).to(dtype)
    dx = tanh_grad(x, dy)
    assert dx.dtype == dtype
    want = dy.double() * sech_squared(x.double())
    error = ((dx.double() - want).abs() / want.abs().clamp(min=torch.finfo(dtype).tiny)).max().item()
    assert error <= 2 * TOLERANCE[dtype], error
    for rows in (slice(0, 1), slice(25, 26), slice(3, 30), torch.randperm(37)):
        assert torch.equal(tanh_grad(x[rows], dy[rows]), dx[rows])


def test_gradient_past_overflow_is_zero_not_nan():
    x = torch.tensor([[50.0, -50.0, 100.0, -100.0, 1e30]])
    assert torch.equal(tanh_grad(x, torch.ones_like(x)), torch.zeros_like(x))


def test_negative_control_the_tolerance_sees_the_cancelling_slope():
    """1 - tanh(x)^2 in fp32 is 0 (or an ulp of 1) at |x| = 9, ~1e-7 relative off: the test above fails it."""
    x = torch.full((1, 8), 9.0)
    cancelling = 1.0 - torch.tanh(x) ** 2
    want = sech_squared(x.double())
    assert ((cancelling.double() - want).abs() / want).max().item() > 100 * TOLERANCE[torch.float32]


def rows_keyed_tanh_grad(x, dy):
    """Negative control: the kernel for up to 4 rows, torch's dy * (1 - tanh^2) for more (a path picked by
    the row count, as a backward that switches strategy at some batch size)."""
    if x.shape[0] <= 4:
        return tanh_grad(x, dy)
    return (dy.float() * (1.0 - torch.tanh(x.float()) ** 2)).to(x.dtype)


def test_negative_control_a_rows_keyed_gradient_is_caught():
    g = torch.Generator().manual_seed(2)
    x, dy = torch.randn(37, 96, generator=g) * 3, torch.randn(37, 96, generator=g)
    full = rows_keyed_tanh_grad(x, dy)
    assert any(not torch.equal(rows_keyed_tanh_grad(x[i:i + 1], dy[i:i + 1]), full[i:i + 1]) for i in range(37))


def test_backward_kernels_compile_for_cuda():
    """Offline (no GPU needed): tanh's and the tanh-form GELU's backward with the CUDA launch's blocks, sm_90."""
    arch = 90
    compile_for(tanh_mod._tanh_backward_kernel, arch, {"ptr": "*bf16"}, dict(BLOCK_ROWS=1, BLOCK_N=1024))
    compile_for(gelu_mod._gelu_backward_kernel, arch, {"ptr": "*bf16"}, dict(BLOCK_ROWS=1, BLOCK_N=1024, TANH=True))
