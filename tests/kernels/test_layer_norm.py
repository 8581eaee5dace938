"""LayerNorm (Qwen3-VL's vision tower): within tolerance of float64, a row alone == in any batch, and the
tolerance sees a missing bias or a norm without the mean removed."""
import pytest
import torch
import torch.nn.functional as F

from helpers.models import DTYPES
from invariant_infer.kernels import layer_norm

TOLERANCE = {torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10, torch.float32: 2e-6}  # relative to max |y|


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [80, 1152])
def test_matches_float64_and_rows_alone_equal_any_batch(dtype, hidden):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(37, hidden, generator=g) * 2 + 0.5).to(dtype)
    weight, bias = (torch.randn(hidden, generator=g).to(dtype) for _ in range(2))
    out = layer_norm(x, weight, bias, 1e-6)
    want = F.layer_norm(x.double(), (hidden,), weight.double(), bias.double(), 1e-6)
    scale = want.abs().max().item()
    assert (out.double() - want).abs().max().item() <= TOLERANCE[dtype] * scale
    for rows in (slice(0, 1), slice(5, 6), slice(3, 20)):
        assert torch.equal(layer_norm(x[rows], weight, bias, 1e-6), out[rows])
    no_bias = F.layer_norm(x.double(), (hidden,), weight.double(), None, 1e-6)
    not_centred = F.rms_norm(x.double(), (hidden,), weight.double(), 1e-6) + bias.double()
    for wrong in (no_bias, not_centred):
        assert (out.double() - wrong).abs().max().item() > 10 * TOLERANCE[dtype] * scale
