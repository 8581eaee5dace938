"""tanh (the encoders' poolers and classification heads): within tolerance of float64, also near 0 where
1 - 2 / (exp(2x) + 1) cancels, and a row alone == in any batch."""
import pytest
import torch

from helpers.models import DTYPES
from invariant_infer.kernels.tanh import tanh

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
