"""The blocked (I + L)^-1 of a strictly lower 64 x 64 block: close to float64's inverse, and row i
bitwise the same whatever rows past i hold (L cut after its first t + 1 rows, as a decode step or
a cut prefill holds it), for cuts inside, at and across the 16-row blocks. Negative control: an
inverse whose row i reads row i + 1 of L moves with the rows past the cut."""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from invariant_infer.kernels.launch import launch
from invariant_infer.kernels.triangular_inverse import unit_lower_inverse

CHUNK, SUB = 64, 16


@triton.jit
def _inverse_kernel(lower_ptr, out_ptr, LEAK: tl.constexpr, CHUNK: tl.constexpr, SUB: tl.constexpr):
    r = tl.arange(0, CHUNK)
    lower = tl.load(lower_ptr + r[:, None] * CHUNK + r[None, :])
    if LEAK:  # the control: every row also sees the next row's values
        below = tl.load(lower_ptr + (r[:, None] + 1) * CHUNK + r[None, :], mask=r[:, None] + 1 < CHUNK, other=0.0)
        lower = lower + 1e-3 * tl.where(r[:, None] > r[None, :], below, 0.0)
    tl.store(out_ptr + r[:, None] * CHUNK + r[None, :], unit_lower_inverse(lower, CHUNK, SUB, 2))


def inverse(lower: torch.Tensor, leak: bool = False) -> torch.Tensor:
    out = torch.empty_like(lower)
    launch(_inverse_kernel, (1,), lower.device, lower.contiguous(), out, LEAK=leak, CHUNK=CHUNK, SUB=SUB)
    return out


@pytest.fixture(scope="module")
def lower():
    g = torch.Generator().manual_seed(0)
    return (torch.rand(CHUNK, CHUNK, generator=g) - 0.5).tril(-1) * 0.5


def test_close_to_the_float64_inverse(lower):
    expected = torch.linalg.inv(torch.eye(CHUNK, dtype=torch.float64) + lower.double())
    assert (inverse(lower).double() - expected).abs().max() <= 2e-5 * expected.abs().max()  # bf16x3 merges: 2^-16


@pytest.mark.parametrize("leak", [False, True], ids=["blocked", "negative-control-leaky"])
def test_row_i_depends_on_rows_0_to_i_alone(lower, leak):
    full = inverse(lower, leak)
    same = []
    for t in (0, 7, 15, 16, 40, 62):
        cut = lower.clone()
        cut[t + 1:] = 0.0
        same.append(torch.equal(inverse(cut, leak)[:t + 1], full[:t + 1]))
    assert all(same) != leak, same
