"""Qwen3.5's norms and gate as kernels: the gated RMSNorm of Gated DeltaNet's output, the zero-centred
RMSNorm (fp32 x (1 + weight)) and the attention's output gate x * sigmoid(gate), against float64 and
row by row: a row's bits never depend on the others (slices and a permutation of the batch)."""
import pytest
import torch
import torch.nn.functional as F

from helpers.models import DTYPES
from invariant_infer.kernels import rms_norm, rms_norm_gated, sigmoid_mul

# Against float64: the roundings to the dtype (after normalising, after the weight, at the end).
TOLERANCE = {torch.bfloat16: 2.4e-2, torch.float16: 3e-3, torch.float32: 2e-6}


def normed(x: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_rms_norm_accuracy_and_row_invariance(dtype):
    x, z = (torch.randn(40, 128) * 3).to(dtype), torch.randn(40, 128).to(dtype)
    w = (1 + 0.1 * torch.randn(128)).to(dtype)
    y = rms_norm_gated(x, z, w, 1e-6)
    ref = w.double() * normed(x, 1e-6) * F.silu(z.double())
    assert y.dtype == dtype
    assert ((y.double() - ref).abs() / ref.abs().clamp_min(1e-2)).max() < TOLERANCE[dtype]
    perm = torch.randperm(40)
    assert torch.equal(rms_norm_gated(x[perm], z[perm], w, 1e-6), y[perm])
    for rows in (slice(0, 1), slice(7, 23)):
        assert torch.equal(rms_norm_gated(x[rows], z[rows], w, 1e-6), y[rows])


@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_centred_rms_norm_accuracy_and_row_invariance(dtype):
    x, w = (torch.randn(40, 96) * 3).to(dtype), (0.1 * torch.randn(96)).to(dtype)
    y = rms_norm(x, w, 1e-6, zero_centred=True)
    ref = normed(x, 1e-6) * (1 + w.double())
    assert y.dtype == dtype
    assert ((y.double() - ref).abs() / ref.abs().clamp_min(1e-2)).max() < TOLERANCE[dtype]
    perm = torch.randperm(40)
    assert torch.equal(rms_norm(x[perm], w, 1e-6, zero_centred=True), y[perm])
    assert torch.equal(rms_norm(x[5:6], w, 1e-6, zero_centred=True), y[5:6])


@pytest.mark.parametrize("dtype", DTYPES)
def test_sigmoid_mul_is_torchs_two_ops_and_row_invariant(dtype):
    x, gate = torch.randn(33, 80).to(dtype), (3 * torch.randn(33, 80)).to(dtype)
    y = sigmoid_mul(x, gate)
    ref = x.double() * torch.sigmoid(gate.double())
    assert ((y.double() - ref).abs() / ref.abs().clamp_min(1e-2)).max() < TOLERANCE[dtype]
    assert torch.equal(sigmoid_mul(x[4:9], gate[4:9]), y[4:9])
    assert torch.equal(sigmoid_mul(x[1:2], gate[1:2]), y[1:2])
