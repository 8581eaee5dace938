"""gpt-oss's clamped SwiGLU expert activation: accuracy against float64 (leaving out the clamp, the
+1 or alpha each misses the tolerance), each row alone == in a larger batch, strided (interleaved)
inputs == contiguous ones."""
import pytest
import torch

from helpers.models import DTYPES
from invariant_infer.kernels import clamped_swiglu

ALPHA, LIMIT = 1.702, 7.0
TOLERANCE = {torch.bfloat16: 4e-3, torch.float16: 5e-4, torch.float32: 1e-6}  # relative to max |y|


def _reference(gate, up, alpha=ALPHA, limit=LIMIT, plus_one=1.0):
    g, u = gate.double().clamp(max=limit), up.double().clamp(-limit, limit)
    return (u + plus_one) * g * torch.sigmoid(g * alpha)


def _gate_up(rows, width, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (4.0 * torch.randn(rows, 2 * width, generator=g)).to(dtype)  # past the clamp both ways


@pytest.mark.parametrize("dtype", DTYPES)
def test_accuracy_and_what_the_tolerance_catches(dtype):
    gate_up = _gate_up(37, 96, dtype)
    gate, up = gate_up[:, 0::2], gate_up[:, 1::2]
    out = clamped_swiglu(gate, up, ALPHA, LIMIT).double()
    scale = _reference(gate, up).abs().max().item()
    error = lambda **changed: (out - _reference(gate, up, **changed)).abs().max().item() / scale  # noqa: E731
    assert error() < TOLERANCE[dtype]
    for changed in (dict(limit=1e9), dict(plus_one=0.0), dict(alpha=1.0)):
        assert error(**changed) > 5 * TOLERANCE[dtype], changed


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_alone_equal_rows_in_a_batch_and_strides_do_not_matter(dtype):
    gate_up = _gate_up(53, 80, dtype, seed=1)
    gate, up = gate_up[:, 0::2], gate_up[:, 1::2]
    batch = clamped_swiglu(gate, up, ALPHA, LIMIT)
    assert torch.equal(batch, clamped_swiglu(gate.contiguous(), up.contiguous(), ALPHA, LIMIT))
    for row in (0, 17, 52):
        assert torch.equal(clamped_swiglu(gate[row:row + 1], up[row:row + 1], ALPHA, LIMIT)[0], batch[row])
