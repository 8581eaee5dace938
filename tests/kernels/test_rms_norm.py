"""RMSNorm and silu*mul kernels: HF's arithmetic, one row at a time."""
import pytest
import torch

from helpers.models import DEVICES, DTYPES
from invariant_infer.kernels import rms_norm, silu_mul

# Against float64: one rounding to the dtype after normalising, one after the weight product.
TOLERANCE = {torch.bfloat16: 1.6e-2, torch.float16: 2e-3, torch.float32: 1e-6}


def hf_rms_norm(x, weight, eps):
    """transformers' Qwen2RMSNorm.forward."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 300, 1536])
def test_rms_norm_accuracy(dtype, device, hidden):
    x = (torch.randn(21, hidden) * 3).to(dtype).to(device)
    w = (1 + 0.1 * torch.randn(hidden)).to(dtype).to(device)
    y = rms_norm(x, w, 1e-6)
    xd = x.double()
    ref = w.double() * xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert y.dtype == dtype
    assert ((y.double() - ref).abs() / ref.abs().clamp_min(1e-3)).max().item() < TOLERANCE[dtype]
    # Against HF's own formula: within a few rounding steps of the output dtype (the fp32 sum
    # order and 1/sqrt vs rsqrt differ by ULPs, which can flip one output rounding).
    assert (y.double() - hf_rms_norm(x, w, 1e-6).double()).abs().max().item() <= \
        4 * torch.finfo(dtype).eps * ref.abs().max().item()


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_scaled_in_fp32_accuracy_and_rows(dtype):
    """gpt-oss's norm: an fp32 weight times the fp32 normed row, rounded once to x's dtype."""
    x = (torch.randn(70, 300) * 3).to(dtype)
    w = 1 + 0.1 * torch.randn(300)
    norm = lambda x, w, eps: rms_norm(x, w, eps, scale_in_fp32=True)  # noqa: E731
    y = norm(x, w, 1e-6)
    xd = x.double()
    ref = w.double() * xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert y.dtype == dtype
    # One rounding, so half the two-rounding tolerance; rounding the normed row first is less accurate.
    relative = lambda y: ((y.double() - ref).abs() / ref.abs().clamp_min(1e-3)).max().item()  # noqa: E731
    assert relative(y) < TOLERANCE[dtype] / 2
    if dtype != torch.float32:
        assert relative(rms_norm(x, w.to(dtype), 1e-6)) > relative(y)
    assert row_mismatches(norm, x, w) == []


def row_mismatches(norm, x, w) -> list:
    """The row subsets (slices, a permutation) whose outputs differ from theirs in the full batch."""
    full = norm(x, w, 1e-6)
    differ = [rows for rows in [slice(3, 4), slice(0, 1), slice(60, 70), slice(5, 38)]
              if not torch.equal(norm(x[rows], w, 1e-6), full[rows])]
    perm = torch.randperm(x.shape[0])
    return differ + ([perm] if not torch.equal(norm(x[perm], w, 1e-6), full[perm]) else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_row_invariance(dtype, device):
    x = torch.randn(70, 1536).to(dtype).to(device)
    w = torch.randn(1536).to(dtype).to(device)
    assert row_mismatches(rms_norm, x, w) == []


def rows_keyed_rms_norm(x, weight, eps):
    """Negative control: the kernel for up to 4 rows, a two-halves sum of squares for more (a
    reduction tree picked by the row count, as a norm that switches strategy at some batch size has)."""
    if x.reshape(-1, x.shape[-1]).shape[0] <= 4:
        return rms_norm(x, weight, eps)
    h = x.float()
    half = h.shape[-1] // 2
    squares = h[..., :half].pow(2).sum(-1, keepdim=True) + h[..., half:].pow(2).sum(-1, keepdim=True)
    return weight * (h * torch.rsqrt(squares / h.shape[-1] + eps)).to(x.dtype)


def test_negative_control_rows_keyed_reduction_is_caught():
    x = torch.randn(70, 1536)
    w = torch.randn(1536)
    assert row_mismatches(rows_keyed_rms_norm, x, w) != []


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_torch_and_is_row_invariant(dtype, device):
    g = (torch.randn(33, 500) * 4).to(dtype).to(device)
    u = torch.randn(33, 500).to(dtype).to(device)
    y = silu_mul(g, u)
    ref = torch.nn.functional.silu(g.double()) * u.double()
    assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < TOLERANCE[dtype]
    assert torch.equal(silu_mul(g[7:8], u[7:8]), y[7:8])
    assert torch.equal(silu_mul(g[20:], u[20:]), y[20:])
