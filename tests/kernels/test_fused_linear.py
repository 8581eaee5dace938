"""The silu_mul prologue fusion: bitwise equal to the unfused kernels, hence batch-invariant too."""
import pytest
import torch

from helpers.models import DEVICES, DTYPES
from invariant_infer.kernels import LinearConfig, linear, silu_mul
from invariant_infer.kernels.fused_linear import silu_mul_linear


def _data(dtype, device, m=37, k=300, n=100):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(m, k, generator=g) * 3).to(dtype).to(device)
    x2 = torch.randn(m, k, generator=g).to(dtype).to(device)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype).to(device)
    b = torch.randn(n, generator=g).to(dtype).to(device)
    return x, x2, w, b


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k_chunks", [1, 2])
def test_silu_mul_linear_equals_unfused(dtype, device, k_chunks):
    gate, up, w, b = _data(dtype, device)
    cfg = None if k_chunks == 1 else LinearConfig(16, 64, 64, k_chunks=k_chunks)
    fused = silu_mul_linear(gate, up, w, b, config=cfg)
    assert torch.equal(fused, linear(silu_mul(gate, up), w, b, config=cfg))
    assert torch.equal(silu_mul_linear(gate[5:6], up[5:6], w, b, config=cfg)[0], fused[5])

