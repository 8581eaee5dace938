"""LayerNorm's autograd: the forward's bits, gradients against float64 (with and without bias), row
invariance of d x, run-twice and any-schedule bits of d x, d weight and d bias.

No gradcheck: the kernels compute in fp32 and take bf16/fp16/fp32 only, so float64 is not theirs.
"""
import sys

import pytest
import torch
import torch.nn.functional as F
import triton

from helpers.kernel_compile import compile_for
from helpers.models import DTYPES
from invariant_infer.kernels import layer_norm, layer_norm_autograd

autograd_mod = sys.modules["invariant_infer.kernels.layer_norm_autograd"]
layer_norm_mod = sys.modules["invariant_infer.kernels.layer_norm"]

EPS = 1e-5
# Max |error| / max |float64 gradient|. d x: fp32 arithmetic, one rounding to the dtype. d weight,
# d bias: fp32 sums over rows, one rounding to the parameter's dtype.
TOLERANCE = {torch.bfloat16: 8e-3, torch.float16: 1e-3, torch.float32: 1e-6}


def inputs(rows, dtype, n=300, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, n, generator=g) * 3 + 0.5).to(dtype)
    w = (1 + 0.1 * torch.randn(n, generator=g)).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    dy = torch.randn(rows, n, generator=g).to(dtype)
    return x, w, b, dy


def kernel_grads(x, w, b, dy):
    leaves = [t.detach().requires_grad_() for t in (x, w, b) if t is not None]
    y = layer_norm_autograd(leaves[0], leaves[1], leaves[2] if b is not None else None, EPS)
    return torch.autograd.grad(y, leaves, dy)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_is_layer_norm_and_gradients_match_float64(dtype, bias):
    x, w, b, dy = inputs(37, dtype, bias=bias)  # 3 programs' worth of rows on CPU, the last partly past M
    leaves = [t.detach().requires_grad_() for t in (x, w, b) if t is not None]
    y = layer_norm_autograd(leaves[0], leaves[1], leaves[2] if bias else None, EPS)
    assert torch.equal(y, layer_norm(x, w, b, EPS))
    grads = torch.autograd.grad(y, leaves, dy)
    leaves64 = [t.detach().double().requires_grad_() for t in (x, w, b) if t is not None]
    y64 = F.layer_norm(leaves64[0], (x.shape[-1],), leaves64[1], leaves64[2] if bias else None, EPS)
    for got, want in zip(grads, torch.autograd.grad(y64, leaves64, dy.double()), strict=True):
        assert got.dtype == dtype and got.shape == want.shape
        assert ((got.double() - want).abs().max() / want.abs().max()).item() < TOLERANCE[dtype]


def test_no_bias_forward_is_the_bias_forward_less_the_bias():
    """Without a bias the forward skips the add: a zero bias gives the same values (and the tolerance
    test above sees a bias that is wrongly added or dropped)."""
    x, w, b, _ = inputs(20, torch.float32)
    assert torch.equal(layer_norm(x, w, None, EPS), layer_norm(x, w, torch.zeros_like(b), EPS))
    assert not torch.equal(layer_norm(x, w, None, EPS), layer_norm(x, w, b, EPS))


def test_three_dim_input_and_only_some_gradients():
    x, w, b, dy = inputs(12, torch.float32)
    full = kernel_grads(x, w, b, dy)
    x3 = x.reshape(3, 4, -1).detach().requires_grad_()
    bias = b.detach().requires_grad_()
    dx, db = torch.autograd.grad(layer_norm_autograd(x3, w, bias, EPS), (x3, bias), dy.reshape(3, 4, -1))
    assert torch.equal(dx.reshape(12, -1), full[0]) and torch.equal(db, full[2])
    with pytest.raises(RuntimeError, match="once_differentiable|double backward|does not require grad"):
        x1 = x.detach().requires_grad_()
        (g,) = torch.autograd.grad(layer_norm_autograd(x1, w, b, EPS), (x1,), dy, create_graph=True)
        g.sum().backward()


def test_same_rows_give_the_same_gradient_bits():
    x, w, b, dy = inputs(70, torch.bfloat16)
    first, second = kernel_grads(x, w, b, dy), kernel_grads(x, w, b, dy)
    assert all(torch.equal(a, c) for a, c in zip(first, second, strict=True))


def row_mismatches(grads, x, w, b, dy) -> list:
    """The row subsets (slices, a permutation) whose input gradients differ from theirs in the full batch."""
    full = grads(x, w, b, dy)[0]
    subsets = [slice(3, 4), slice(0, 1), slice(60, 70), slice(5, 38), torch.randperm(x.shape[0])]
    return [rows for rows in subsets if not torch.equal(grads(x[rows], w, b, dy[rows])[0], full[rows])]


@pytest.mark.parametrize("dtype", DTYPES)
def test_input_gradient_of_a_row_does_not_depend_on_the_other_rows(dtype):
    assert row_mismatches(kernel_grads, *inputs(70, dtype, n=768)) == []


def rows_keyed_grads(x, w, b, dy):
    """Negative control: the kernel for up to 4 rows, a two-halves sum of dn * n for more (a reduction
    tree picked by the row count, as a backward that switches strategy at some batch size)."""
    if x.shape[0] <= 4:
        return kernel_grads(x, w, b, dy)
    xf, dn = x.float(), dy.float() * w.float()
    centred = xf - xf.mean(-1, keepdim=True)
    rstd = torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + EPS)
    normed, half = centred * rstd, x.shape[-1] // 2
    dot = ((dn[:, :half] * normed[:, :half]).sum(-1, keepdim=True)
           + (dn[:, half:] * normed[:, half:]).sum(-1, keepdim=True))
    return (rstd * (dn - dn.mean(-1, keepdim=True) - normed * dot / x.shape[-1])).to(x.dtype), None, None


def test_negative_control_rows_keyed_reduction_is_caught():
    assert row_mismatches(rows_keyed_grads, *inputs(70, torch.float32, n=768)) != []


SCHEDULES = (1, 5)  # groups per program; the interpreter's default runs all of them in one


def schedule_mismatches(backward, x, w, b, dy) -> list:
    """The schedules (groups per program) whose d x, d weight or d bias differ from the default's."""
    default = backward(x, w, b, dy, None)
    return [per_program for per_program in SCHEDULES
            if not all(got is want or torch.equal(got, want)
                       for got, want in zip(backward(x, w, b, dy, per_program), default, strict=True))]


def kernel_backward(x, w, b, dy, groups_per_program):
    return autograd_mod.layer_norm_backward(x, w, b, EPS, dy, groups_per_program=groups_per_program)


def test_parameter_gradients_schedule_never_moves_their_bits_and_match_float64():
    """d weight's and d bias's leaves are 64-row groups from row 0: 300 rows make 5 groups; one group
    per program, 5 at a time and all in one program give the same bits, within one rounding of float64."""
    x, w, b, dy = inputs(300, torch.bfloat16, n=48)
    assert schedule_mismatches(kernel_backward, x, w, b, dy) == []
    _, dw, db = kernel_backward(x, w, b, dy, None)
    x64 = x.double()
    normed = (x64 - x64.mean(-1, keepdim=True)) * torch.rsqrt(x64.var(-1, unbiased=False, keepdim=True) + EPS)
    for got, want in ((dw, (dy.double() * normed).sum(0)), (db, dy.double().sum(0))):
        assert got.dtype == torch.bfloat16
        assert ((got.double() - want).abs().max() / want.abs().max()).item() < TOLERANCE[torch.bfloat16]


def program_keyed_backward(x, w, b, dy, groups_per_program):
    """Negative control: d bias summed per program, then the programs' sums in order (a tree that
    follows the program count, i.e. the schedule)."""
    rows_per_program = 64 * (groups_per_program or triton.cdiv(x.shape[0], 64))
    acc = torch.zeros(x.shape[-1])
    for part in dy.float().split(rows_per_program):
        acc = acc + part.sum(0)
    return torch.zeros_like(x), None, acc.to(x.dtype)


def test_negative_control_a_program_keyed_bias_gradient_is_caught():
    assert schedule_mismatches(program_keyed_backward, *inputs(4200, torch.float32, n=48)) != []


@pytest.mark.fast_cells(1)
@pytest.mark.parametrize("arch", [90, 80])
def test_backward_kernel_compiles_for_cuda(arch):
    """Offline (no GPU needed): the backward kernel with the CUDA launch's blocks and pinned options."""
    block_rows, block_n, warps = layer_norm_mod.launch_params(torch.device("cuda"), 1024)
    assert compile_for(autograd_mod._layer_norm_backward_kernel, arch,
                       {"ptr": "*bf16", "part_w_ptr": "*fp32", "part_b_ptr": "*fp32", "eps": "fp32"},
                       dict(BLOCK_ROWS=block_rows, BLOCK_N=block_n, PARAM_GRAD=True,
                            GROUP_ROWS=autograd_mod.GROUP_ROWS), warps)
