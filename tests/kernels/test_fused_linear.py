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



def test_fusing_the_prologue_is_a_schedule():
    """Fused and unfused (silu_mul once, then linear) give the same bits with a GPU rule's
    row-parallel split-K config (a K = 1536 projection, two N tiles: 8 leaves of 3 BLOCK_Ks), on
    either chunk schedule; a GPU fuses only at one row tile, the interpreter always."""
    from invariant_infer.kernels.configs import row_parallel_config
    from invariant_infer.kernels.fused_linear import prologue_pays
    cfg = row_parallel_config("cuda", torch.bfloat16, 1536, 1536)
    assert cfg.k_chunks == 8
    gate, up, w, b = _data(torch.bfloat16, "cpu", m=5, k=1536, n=2 * cfg.block_n)
    fused = silu_mul_linear(gate, up, w, b, config=cfg, parallel_chunks=True, fused=True)
    assert torch.equal(silu_mul_linear(gate, up, w, b, config=cfg, parallel_chunks=False, fused=False), fused)
    assert torch.equal(silu_mul_linear(gate, up, w, b, config=cfg, parallel_chunks=True, fused=False), fused)
    assert torch.equal(linear(silu_mul(gate, up), w, b, config=cfg, parallel_chunks=False), fused)
    assert [prologue_pays(torch.device("cuda"), m, cfg) for m in (1, cfg.block_m, cfg.block_m + 1)] == [True, True, False]
    assert prologue_pays(torch.device("cpu"), 4096, cfg)
