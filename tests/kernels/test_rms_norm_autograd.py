"""RMSNorm's autograd: the forward's bits, gradients against float64, row invariance of d x,
run-twice bits of d x and d weight.

No gradcheck: the kernels compute in fp32 and take bf16/fp16/fp32 only, so float64 is not theirs.
"""
import sys

import pytest
import torch
import triton

from helpers.kernel_compile import compile_for
from helpers.models import DEVICES, DTYPES
from invariant_infer.kernels import rms_norm, rms_norm_autograd

autograd_mod = sys.modules["invariant_infer.kernels.rms_norm_autograd"]
launch_mod = sys.modules["invariant_infer.kernels.launch"]
rms_mod = sys.modules["invariant_infer.kernels.rms_norm"]

EPS = 1e-6
# Max |error| / max |float64 gradient|. d x: fp32 arithmetic, one rounding to the dtype. d weight:
# a sum over rows of dy * normed x rounded to the dtype (as the forward rounds it), one rounding.
TOLERANCE = {torch.bfloat16: 8e-3, torch.float16: 1e-3, torch.float32: 1e-6}


def inputs(rows, dtype, device, n=300):
    x = (torch.randn(rows, n) * 3).to(dtype).to(device)
    w = (1 + 0.1 * torch.randn(n)).to(dtype).to(device)
    dy = torch.randn(rows, n).to(dtype).to(device)
    return x, w, dy


def kernel_grads(x, w, dy):
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    return torch.autograd.grad(rms_norm_autograd(x, w, EPS), (x, w), dy)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_is_rms_norm_and_gradients_match_float64(dtype, device):
    x, w, dy = inputs(37, dtype, device)  # 3 programs on CPU, the last one partly past the rows
    xr, wr = x.detach().requires_grad_(), w.detach().requires_grad_()
    y = rms_norm_autograd(xr, wr, EPS)
    assert torch.equal(y, rms_norm(x, w, EPS))
    grads = torch.autograd.grad(y, (xr, wr), dy)
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    y64 = w64 * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + EPS)
    for got, want in zip(grads, torch.autograd.grad(y64, (x64, w64), dy.double())):
        assert got.dtype == dtype and got.shape == want.shape
        assert ((got.double() - want).abs().max() / want.abs().max()).item() < TOLERANCE[dtype]


def test_three_dim_input_and_no_weight_grad():
    x, w, dy = inputs(12, torch.float32, "cpu")
    x3 = x.reshape(3, 4, -1).requires_grad_()
    (dx,) = torch.autograd.grad(rms_norm_autograd(x3, w, EPS), (x3,), dy.reshape(3, 4, -1))
    assert torch.equal(dx.reshape(12, -1), kernel_grads(x, w, dy)[0])


@pytest.mark.parametrize("dtype", DTYPES)
def test_same_rows_give_the_same_gradient_bits(dtype):
    x, w, dy = inputs(70, dtype, "cpu")
    first, second = kernel_grads(x, w, dy), kernel_grads(x, w, dy)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def row_mismatches(grads, x, w, dy) -> list:
    """The row subsets (slices, a permutation) whose input gradients differ from theirs in the full batch."""
    full = grads(x, w, dy)[0]
    subsets = [slice(3, 4), slice(0, 1), slice(60, 70), slice(5, 38), torch.randperm(x.shape[0])]
    return [rows for rows in subsets if not torch.equal(grads(x[rows], w, dy[rows])[0], full[rows])]


@pytest.mark.parametrize("dtype", DTYPES)
def test_input_gradient_of_a_row_does_not_depend_on_the_other_rows(dtype):
    assert row_mismatches(kernel_grads, *inputs(70, dtype, "cpu", n=1536)) == []


def rows_keyed_grads(x, w, dy):
    """Negative control: the kernel for up to 4 rows, a two-halves sum of dn * normed for more (a
    reduction tree picked by the row count, as a backward that switches strategy at some batch size)."""
    if x.shape[0] <= 4:
        return kernel_grads(x, w, dy)
    xf, dn = x.float(), dy.float() * w.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)
    normed, half = xf * rstd, x.shape[-1] // 2
    dot = (dn[:, :half] * normed[:, :half]).sum(-1, keepdim=True) + (dn[:, half:] * normed[:, half:]).sum(-1, keepdim=True)
    return (rstd * (dn - normed * dot / x.shape[-1])).to(x.dtype), None


def test_negative_control_rows_keyed_reduction_is_caught():
    assert row_mismatches(rows_keyed_grads, *inputs(70, torch.float32, "cpu", n=1536)) != []


SCHEDULES = (1, 5)  # groups per program; the interpreter's default runs all of them in one


def schedule_mismatches(backward, x, w, dy) -> list:
    """The schedules (groups per program) whose d x or d weight differ from the default schedule's."""
    dx, dw = backward(x, w, dy, None)
    return [per_program for per_program in SCHEDULES
            if not all(torch.equal(a, b) for a, b in zip(backward(x, w, dy, per_program), (dx, dw)))]


def kernel_backward(x, w, dy, groups_per_program):
    return autograd_mod.rms_norm_backward(x, w, EPS, dy, groups_per_program=groups_per_program)


def test_weight_gradient_schedule_never_moves_its_bits_and_matches_float64():
    """d weight's leaves are 64-row groups from row 0: 300 rows make 5 groups; one group per
    program, 5 at a time and all in one program give the same d x and d weight bits, within one
    rounding of float64."""
    x, w, dy = inputs(300, torch.bfloat16, "cpu", n=48)
    assert schedule_mismatches(kernel_backward, x, w, dy) == []
    assert autograd_mod.row_group_schedule(torch.device("cpu"), 5) == 5
    dw = kernel_backward(x, w, dy, None)[1]
    x64 = x.double()
    want = (dy.double() * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + EPS)).sum(0)
    assert dw.dtype == torch.bfloat16
    assert ((dw.double() - want).abs().max() / want.abs().max()).item() < TOLERANCE[torch.bfloat16]


def test_group_sums_reduce_level_by_level_whatever_the_schedule():
    """Above the leaves: 4,200 group sums are 66 groups of 64, then one: two levels. Each schedule
    gives the same bits, the fp32 result within fp32 rounding of the float64 sum."""
    partial = torch.randn(4200, 48, generator=torch.Generator().manual_seed(0))
    results = []
    for per_program in (None, 1, 5):
        dw = torch.empty(48, dtype=torch.float32)
        autograd_mod._sum_levels(partial, dw, 16, 64, per_program)
        results.append(dw)
    assert all(torch.equal(dw, results[0]) for dw in results)
    want = partial.double().sum(0)
    assert ((results[0].double() - want).abs().max() / want.abs().max()).item() < 1e-5


def program_keyed_backward(x, w, dy, groups_per_program):
    """Negative control: d weight summed per program, then the programs' sums in order (the backward
    before the fixed groups: its tree follows the program count, i.e. the schedule)."""
    xf = x.float()
    terms = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype).float() * dy.float()
    rows_per_program = 64 * (groups_per_program or triton.cdiv(x.shape[0], 64))
    acc = torch.zeros(x.shape[-1])
    for part in terms.split(rows_per_program):
        acc = acc + part.sum(0)
    return torch.zeros_like(x), acc.to(x.dtype)


def test_negative_control_a_program_keyed_weight_gradient_is_caught():
    assert schedule_mismatches(program_keyed_backward, *inputs(4200, torch.float32, "cpu", n=48)) != []


@pytest.mark.fast_cells(2)
@pytest.mark.parametrize("arch", [90, 89, 80])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_backward_kernels_compile_for_cuda(arch, dtype):
    """Offline (no GPU needed): both kernels, with the CUDA launch's blocks and pinned options."""
    element = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}[dtype]
    for hidden in (1536, 5120):
        block_rows, block_n, warps = rms_mod._launch_params(torch.device("cuda"), hidden)
        assert compile_for(autograd_mod._rms_norm_backward_kernel, arch, {"ptr": element, "part_ptr": "*fp32", "eps": "fp32"},
                           dict(BLOCK_ROWS=block_rows, BLOCK_N=block_n, WEIGHT_GRAD=True,
                                GROUP_ROWS=autograd_mod.GROUP_ROWS), warps)
    for out in ("*fp32", element):  # a level below the root, the root in the weight's dtype
        assert compile_for(autograd_mod._sum_row_groups_kernel, arch, {"ptr": out, "in_ptr": "*fp32"},
                           dict(BLOCK_ROWS=1, BLOCK_N=1024, GROUP_ROWS=autograd_mod.GROUP_ROWS), 4)
